"""Megatron parameter specs from a Hugging Face ``config.json`` (metadata only, any model size).

``param_specs_from_hf_config(config)`` lists every Megatron-Core parameter of the model (local
transformer-layer spec, ``SequentialMLP`` experts: the names the CPU trainer has) with its full
shape, TP split axis and the checkpoint-style HF tensors it converts to, without allocating.

Families registered in ``megarl.checkpoint.families`` (``qwen3``, ``qwen3_moe``) come from their
mapping tables: names and shapes from ``Family.megatron_shapes``, TP split from the table, HF names
and shapes by running the family's own ``megatron_to_hf`` on ``meta`` tensors (no memory).

``deepseek_v3`` (MLA + shared experts + dense first layers, bf16) is metadata defined here because
no DeepSeek family exists in ``megarl.checkpoint`` yet:
MLA projections keep their HF layout in Megatron (``linear_q_up_proj`` = ``q_b_proj``,
``linear_kv_up_proj`` = ``kv_b_proj``, ``linear_q/kv_down_proj`` = ``q_a_proj`` /
``kv_a_proj_with_mqa``), the router's ``expert_bias`` is ``e_score_correction_bias``. It is
metadata for plans (shapes, ownership, bytes); it is not a tested weight converter, and it leaves
out the multi-token-prediction layer and the FP8 block scales of the released checkpoint.

How SGLang shards each HF tensor (:class:`EngineSplit`) is decided by the tensor's name
(:func:`engine_split_for`).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

from megarl.weight_sync.specs import EngineSplit, HFTensorSpec, ParamSpec, SpecError

_ROWS = ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
_COLS = ("o_proj", "down_proj")
_KV = ("k_proj", "v_proj")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")


def engine_split_for(hf_name: str) -> EngineSplit:
    """How SGLang 0.5.23 shards the HF tensor ``hf_name`` over TP ranks (by its module name)."""
    if hf_name.startswith(("model.embed_tokens.", "lm_head.")):
        return EngineSplit.VOCAB
    module = hf_name.rsplit(".", 2)[-2] if hf_name.count(".") >= 2 else ""
    if module in _ROWS:
        return EngineSplit.ROWS
    if module in _COLS:
        return EngineSplit.COLS
    if module in _KV:
        return EngineSplit.KV_HEADS
    return EngineSplit.REPLICATED


def hf_tensor(name: str, shape: tuple[int, ...], dtype: str, *, head_dim: int = 0) -> HFTensorSpec:
    """An :class:`HFTensorSpec` whose engine split and expert id follow from its name."""
    match = _EXPERT_RE.search(name)
    split = engine_split_for(name)
    return HFTensorSpec(name, tuple(shape), dtype, split, int(match.group(1)) if match else None,
                        head_dim if split is EngineSplit.KV_HEADS else 0)


def _get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if config.get(n) is not None:
            return config[n]
    if default is not None:
        return default
    raise SpecError(f"config.json: missing field {' / '.join(names)}")


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # transformers.PretrainedConfig (either spelling of the fields)
        return config.to_dict()
    raise SpecError(f"expected a config.json dict or a transformers config, got {type(config).__name__}")


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int, make_vocab_size_divisible_by: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


class _Builder:
    """Collects specs; one method per block of the model."""

    def __init__(self, cfg: dict, dtype: str, tp_size: int, divisible_by: int):
        self.cfg, self.dtype, self.specs = cfg, dtype, []
        self.hidden = _get(cfg, "hidden_size")
        self.vocab = _get(cfg, "vocab_size")
        self.padded_vocab = padded_vocab_size(self.vocab, tp_size, divisible_by)

    def add(self, name: str, shape, tp_axis: Optional[int], hf: list[tuple[str, tuple]], **kw) -> None:
        head_dim = kw.pop("head_dim", 0)
        tensors = tuple(hf_tensor(n, s, self.dtype, head_dim=head_dim) for n, s in hf)
        self.specs.append(ParamSpec(name, tuple(shape), self.dtype, tp_axis, tensors, **kw))

    def embedding_and_head(self, num_layers: int) -> None:
        h, v, vp = self.hidden, self.vocab, self.padded_vocab
        self.add("embedding.word_embeddings.weight", (vp, h), 0, [("model.embed_tokens.weight", (v, h))],
                 first_stage=True, extra={"vocab_size": v})
        self.add("decoder.final_layernorm.weight", (h,), None, [("model.norm.weight", (h,))])
        tied = bool(self.cfg.get("tie_word_embeddings", False))
        self.add("output_layer.weight", (vp, h), 0, [] if tied else [("lm_head.weight", (v, h))],
                 extra={"vocab_size": v})

    def norms(self, layer: int) -> None:
        h, d, m = self.hidden, f"decoder.layers.{layer}", f"model.layers.{layer}"
        self.add(f"{d}.input_layernorm.weight", (h,), None, [(f"{m}.input_layernorm.weight", (h,))], layer=layer)
        self.add(f"{d}.pre_mlp_layernorm.weight", (h,), None,
                 [(f"{m}.post_attention_layernorm.weight", (h,))], layer=layer)

    def mla_attention(self, layer: int) -> None:
        cfg, h = self.cfg, self.hidden
        nh, q_rank, kv_rank = _get(cfg, "num_attention_heads"), _get(cfg, "q_lora_rank"), _get(cfg, "kv_lora_rank")
        nope, rope, vd = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
        d, m = f"decoder.layers.{layer}.self_attention", f"model.layers.{layer}.self_attn"
        table = [  # Megatron module, HF module, shape, tp_axis, rows/columns per head
            ("linear_q_down_proj", "q_a_proj", (q_rank, h), None, 1),
            ("q_layernorm", "q_a_layernorm", (q_rank,), None, 1),
            ("linear_q_up_proj", "q_b_proj", (nh * (nope + rope), q_rank), 0, nope + rope),
            ("linear_kv_down_proj", "kv_a_proj_with_mqa", (kv_rank + rope, h), None, 1),
            ("kv_layernorm", "kv_a_layernorm", (kv_rank,), None, 1),
            ("linear_kv_up_proj", "kv_b_proj", (nh * (nope + vd), kv_rank), 0, nope + vd),
            ("linear_proj", "o_proj", (h, nh * vd), 1, vd),
        ]
        for mcore, hf, shape, axis, unit in table:
            self.add(f"{d}.{mcore}.weight", shape, axis, [(f"{m}.{hf}.weight", shape)], layer=layer, tp_unit=unit)

    def gated_mlp(self, prefix: str, hf_prefix: str, inter: int, layer: int, expert: Optional[int] = None) -> None:
        h = self.hidden
        self.add(f"{prefix}.linear_fc1.weight", (2 * inter, h), 0,
                 [(f"{hf_prefix}.gate_proj.weight", (inter, h)), (f"{hf_prefix}.up_proj.weight", (inter, h))],
                 layer=layer, expert=expert, gated=True)
        self.add(f"{prefix}.linear_fc2.weight", (h, inter), 1, [(f"{hf_prefix}.down_proj.weight", (h, inter))],
                 layer=layer, expert=expert)

    def moe(self, layer: int, num_experts: int, inter: int, router_bias: bool) -> None:
        d, m, h = f"decoder.layers.{layer}.mlp", f"model.layers.{layer}.mlp", self.hidden
        self.add(f"{d}.router.weight", (num_experts, h), None, [(f"{m}.gate.weight", (num_experts, h))], layer=layer)
        if router_bias:
            self.specs.append(ParamSpec(
                f"{d}.router.expert_bias", (num_experts,), "float32", None,
                (hf_tensor(f"{m}.gate.e_score_correction_bias", (num_experts,), "float32"),), layer=layer))
        for e in range(num_experts):
            self.gated_mlp(f"{d}.experts.local_experts.{e}", f"{m}.experts.{e}", inter, layer, expert=e)


def _deepseek_v3(b: _Builder) -> None:
    cfg = b.cfg
    num_layers = _get(cfg, "num_hidden_layers")
    num_experts = _get(cfg, "n_routed_experts")
    first_dense = cfg.get("first_k_dense_replace") or 0
    shared = (cfg.get("n_shared_experts") or 0) * _get(cfg, "moe_intermediate_size")
    b.embedding_and_head(num_layers)
    for layer in range(num_layers):
        b.norms(layer)
        b.mla_attention(layer)
        d, m = f"decoder.layers.{layer}.mlp", f"model.layers.{layer}.mlp"
        if layer < first_dense:
            b.gated_mlp(d, m, _get(cfg, "intermediate_size"), layer)
            continue
        b.moe(layer, num_experts, _get(cfg, "moe_intermediate_size"),
              router_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc")
        if shared:
            b.gated_mlp(f"{d}.shared_experts", f"{m}.shared_experts", shared, layer)


LOCAL_FAMILIES: dict[str, Callable[[_Builder], None]] = {"deepseek_v3": _deepseek_v3}
"""Metadata builders for HF ``model_type`` values that ``megarl.checkpoint.families`` lacks."""

_TP_AXIS = {"none": None, "column": 0, "glu": 0, "row": 1}


def _hf_config_object(cfg: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**cfg)


def _tp_unit(name: str, entry, layout) -> int:
    """Rows/columns per attention query group / head: Megatron splits attention by whole groups/heads."""
    if entry.transform.value == "qkv":
        return (layout.num_attention_heads // layout.num_query_groups + 2) * layout.head_dim
    if name.endswith("self_attention.linear_proj.weight"):
        return layout.head_dim
    return 1


def _specs_from_family(family, cfg: dict, dtype: str, tp_size: int, divisible_by: int) -> list[ParamSpec]:
    import torch

    from megarl.checkpoint.mapping import Transform, lookup, megatron_to_hf, template_of

    hf_config = _hf_config_object(cfg)
    layout = family.layout(hf_config, make_vocab_size_divisible_by=divisible_by, tp_size=tp_size)
    specs = []
    for name, shape in family.megatron_shapes(family.architecture(hf_config)).items():
        entry, _ = lookup(family.table, name)
        _, index = template_of(name)
        if entry.transform is Transform.VOCAB:
            shape = (layout.padded_vocab_size,) + tuple(shape[1:])
        outputs = megatron_to_hf([(name, torch.empty(shape, device="meta"))], layout, family.table)
        head_dim = layout.head_dim if entry.transform is Transform.QKV else 0
        hf = tuple(hf_tensor(n, tuple(t.shape), dtype, head_dim=head_dim) for n, t in outputs)
        specs.append(ParamSpec(
            name, tuple(shape), dtype, _TP_AXIS[entry.tp_split.value], hf, layer=index.get("L"),
            expert=index.get("E") if entry.expert else None, first_stage=name.startswith("embedding."),
            gated=entry.tp_split.value == "glu", tp_unit=_tp_unit(name, entry, layout)))
    return specs


def param_specs_from_hf_config(config: Any, *, tensor_model_parallel_size: int = 1,
                               make_vocab_size_divisible_by: int = 128,
                               dtype: Optional[str] = None) -> list[ParamSpec]:
    """Every Megatron parameter of the model described by an HF config, in model order.

    Args:
        config: a ``config.json`` dict or a ``transformers`` config (both spellings of expert
            counts are accepted: ``num_experts`` and ``num_local_experts``).
        tensor_model_parallel_size: the trainer's TP (Megatron pads the vocabulary to a
            multiple of ``make_vocab_size_divisible_by * TP``).
        make_vocab_size_divisible_by: Megatron's vocabulary padding multiple.
        dtype: parameter dtype name; default: the config's ``torch_dtype``/``dtype``, else bfloat16.

    Returns:
        Parameter specs (no tensors are allocated).

    Raises:
        SpecError: unknown ``model_type`` or a missing field (named).
    """
    from megarl.checkpoint.families import get_family

    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    dtype = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if model_type in LOCAL_FAMILIES:
        builder = _Builder(cfg, dtype, tensor_model_parallel_size, make_vocab_size_divisible_by)
        LOCAL_FAMILIES[model_type](builder)
        return builder.specs
    try:
        family = get_family(model_type)
    except ValueError as err:
        raise SpecError(f"config.json: model_type {model_type!r} has no weight-sync metadata: {err} "
                        f"(plus local metadata for {', '.join(sorted(LOCAL_FAMILIES))})") from None
    try:
        return _specs_from_family(family, cfg, dtype, tensor_model_parallel_size, make_vocab_size_divisible_by)
    except (KeyError, AttributeError, TypeError) as err:
        raise SpecError(f"config.json ({model_type}): {err}") from err
