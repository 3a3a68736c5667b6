"""Megatron parameter specs from a Hugging Face ``config.json`` (metadata only, any model size).

``param_specs_from_hf_config(config)`` lists every Megatron-Core parameter of the model with its
full shape, TP split axis and the checkpoint-style HF tensors it converts to, without allocating:
names and shapes come from the family's ``Family.megatron_shapes`` (``megarl.models.families``:
qwen3, qwen3_moe, deepseek_v3, glm4_moe, ...), the TP split from its mapping table, and the HF
names and shapes from running the family's own ``megatron_to_hf`` on ``meta`` tensors (no memory).

How SGLang shards each HF tensor (:class:`EngineSplit`) follows from the tensor's module name
(:func:`engine_split_for`); that is SGLang knowledge (0.5.23 model definitions), not the trainer's.
Which tensors are routed experts, and their expert ids, come from the family's mapping table (its
``expert`` entries and their ``{E}``), whatever module holds them (``mlp.experts.{E}``, MiniMax-M2's
``block_sparse_moe.experts.{E}.w1``).
So is :func:`engine_table`: a tied checkpoint of a family whose SGLang class keeps its own
``lm_head`` gets the trained embedding as ``lm_head.weight`` too, every sync.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.weight_sync.specs import EngineSplit, HFTensorSpec, ParamSpec, SpecError

_ROWS = ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
"""Column-parallel in SGLang: rows split over TP."""
_COLS = ("o_proj", "down_proj")
"""Row-parallel in SGLang: columns split over TP."""
_KV = ("k_proj", "v_proj")
_FULL_HEAD_NORMS = {"q_norm": EngineSplit.ROWS, "k_norm": EngineSplit.KV_HEADS}
"""q/k norms over all heads (``Family.qk_norm_over_heads``, MiniMax-M2): SGLang 0.5.23's
``MiniMaxM2RMSNormTP`` holds the weight of its rank's heads, as the q / k projections split them
(``models/minimax_m2.py`` lines 288-347); per-head q/k norms (Qwen3) are replicated."""
_EXPERT_SPLITS = {"glu": EngineSplit.ROWS, "column": EngineSplit.ROWS, "row": EngineSplit.COLS,
                  "none": EngineSplit.REPLICATED}
"""A routed expert's HF tensors by the Megatron entry's TP split: SGLang's ``FusedMoE`` splits the
experts' intermediate dimension (``w13_weight`` rows, ``w2_weight`` columns), as Megatron's expert TP;
an unsplit one (a down-projection bias) is whole on each of the expert's ranks."""
_MLP = ("gate_proj", "up_proj", "down_proj")
"""MLP projections: their intermediate dimension is what a CPU engine pads (:func:`mlp_sections`)."""
_TP_AXIS = {"none": None, "column": 0, "glu": 0, "row": 1, "gdn_in_proj": 0, "gdn_conv": 0}
_HEAD_ROWS = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
              "self_attention.linear_kv_up_proj.weight")
"""Column-parallel attention projections whose rows come in whole heads (MLA / q-only)."""
_LINEAR_ATTN = {"in_proj_qkv": EngineSplit.SECTION_ROWS, "conv1d": EngineSplit.SECTION_ROWS,
                "dt_bias": EngineSplit.SECTION_ROWS, "A_log": EngineSplit.SECTION_ROWS,
                "in_proj_z": EngineSplit.ROWS, "in_proj_b": EngineSplit.ROWS, "in_proj_a": EngineSplit.ROWS,
                "out_proj": EngineSplit.COLS}
"""The gated DeltaNet's tensors (``model.layers.L.linear_attn.<module>[.weight]``) in SGLang 0.5.23's
``Qwen3_5GatedDeltaNet`` (``models/qwen3_5.py``): ``in_proj_qkvz`` / ``in_proj_ba`` merged column-parallel,
``conv1d`` column-parallel by sections, ``dt_bias`` / ``A_log`` split by their own loader, ``out_proj``
row-parallel; its ``norm`` is replicated."""
_STACKED = {"gate_up_proj": EngineSplit.COLS, "gate_up_proj_bias": EngineSplit.ROWS, "down_proj": EngineSplit.ROWS,
            "down_proj_bias": EngineSplit.REPLICATED}
"""Expert E's slice ``mlp.experts.<stack>[E]`` of a tensor stacking a layer's experts (gpt-oss, HF
``x @ W`` layout: ``gate_up_proj[E] [H, 2F]``, ``down_proj[E] [F, H]``), as SGLang 0.5.23 splits the
stack over its MoE TP ranks: ``_load_normal_weights`` transposes the weights (``models/gpt_oss.py:1271``)
and ``FusedMoE._load_w13`` / ``_load_w2`` narrow ``w13``'s 2F rows (the bias: its last dim) and
``w2``'s F columns by ``moe_tp_rank`` (``layers/moe/fused_moe_triton/layer.py:788-960``); the down
bias stays whole (zeroed on ranks > 0, ``models/gpt_oss.py:1272-1275``)."""
FP32_PARAMS = ("mlp.router.expert_bias",)
"""Megatron keeps these in fp32 whatever the model dtype (the router's expert-bias buffer)."""


def engine_split_for(hf_name: str, hf_prefix: str = "", *, qk_norm_over_heads: bool = False) -> EngineSplit:
    """How SGLang 0.5.23 shards the HF tensor ``hf_name`` over TP ranks (by its module name);
    ``hf_prefix``: the family's ``Family.hf_prefix`` (Kimi-K2.5's ``language_model.``);
    ``qk_norm_over_heads``: the family's (q/k norms split by heads, :data:`_FULL_HEAD_NORMS`)."""
    if hf_name.startswith((hf_prefix + "model.embed_tokens.", hf_prefix + "lm_head.")):
        return EngineSplit.VOCAB
    base, expert = _expert_slice(hf_name)
    if expert is not None:
        return _STACKED.get(base.rsplit(".", 1)[1], EngineSplit.REPLICATED)
    if ".linear_attn." in hf_name:
        tail = hf_name.split(".linear_attn.", 1)[1].split(".")[0]
        return _LINEAR_ATTN.get(tail, EngineSplit.REPLICATED)
    parts = hf_name.rsplit(".", 2)
    module = parts[-2] if len(parts) == 3 else ""
    if qk_norm_over_heads and module in _FULL_HEAD_NORMS:
        return _FULL_HEAD_NORMS[module]
    if module in _ROWS:
        return EngineSplit.ROWS
    if module in _COLS:  # a row-parallel layer's bias (gpt-oss's o_proj) is whole on every rank
        return EngineSplit.REPLICATED if parts[-1] == "bias" else EngineSplit.COLS
    if module in _KV:
        return EngineSplit.KV_HEADS
    return EngineSplit.REPLICATED


def mlp_sections(hf_name: str, n_shared_experts: int = 1) -> int:
    """:attr:`HFTensorSpec.mlp_sections` of the HF tensor ``hf_name``: ``n_shared_experts`` for a DeepSeek-V3 /
    GLM-4.5 shared expert (``mlp.shared_experts.``: SGLang 0.5.23 builds it ``config.moe_intermediate_size *
    config.n_shared_experts`` wide, ``models/deepseek_v2.py:870``, ``models/glm4_moe.py:472``, from the size its
    CPU runner padded), 1 for any other MLP projection (dense ``mlp.``, ``mlp.experts.E.``, Qwen's
    ``mlp.shared_expert.`` of ``shared_expert_intermediate_size``), 0 for a tensor that is none."""
    parts = hf_name.rsplit(".", 2)
    if len(parts) < 3 or parts[-2] not in _MLP or ".mlp." not in hf_name:
        return 0
    return n_shared_experts if ".mlp.shared_experts." in hf_name else 1


def hf_tensor(name: str, shape: tuple[int, ...], dtype: str, *, head_dim: int = 0, hf_prefix: str = "",
              sections: tuple[int, ...] = (), expert: int | None = None, expert_tp_split: str = "",
              qk_norm_over_heads: bool = False, n_shared_experts: int = 1) -> HFTensorSpec:
    """An :class:`HFTensorSpec`: a routed expert's (``expert``: its global id, from the family table)
    split by its Megatron entry's ``expert_tp_split`` (:data:`_EXPERT_SPLITS`), any other tensor's by its
    name (:func:`engine_split_for`); ``sections``: the row sections of an ``EngineSplit.SECTION_ROWS``
    tensor (default: one, all its rows). A slice ``stack[E]`` of a tensor stacking a layer's experts
    (gpt-oss) is split as SGLang splits its stack (:data:`_STACKED`). Its MLP sections
    (:func:`mlp_sections`) follow from its name and the model's ``n_shared_experts``.

    Raises:
        SpecError: an expert tensor whose entry's split SGLang's ``FusedMoE`` does not have.
    """
    stacked = _expert_slice(name)[1]
    if expert is not None and stacked is None:
        if expert_tp_split not in _EXPERT_SPLITS:
            raise SpecError(f"{name}: expert tensor with TP split {expert_tp_split!r} "
                            f"(known: {sorted(_EXPERT_SPLITS)})")
        split = _EXPERT_SPLITS[expert_tp_split]
    else:  # a stack's expert slice (gpt-oss's mlp.experts.gate_up_proj[E]): by its stack (_STACKED)
        split = engine_split_for(name, hf_prefix, qk_norm_over_heads=qk_norm_over_heads)
        expert = expert if expert is not None else stacked
    return HFTensorSpec(name, tuple(shape), dtype, split, expert, head_dim if split is EngineSplit.KV_HEADS else 0,
                        sections=(sections or (shape[0],)) if split is EngineSplit.SECTION_ROWS else (),
                        mlp_sections=mlp_sections(name, n_shared_experts))


def engine_table(family, hf_config) -> Mapping:
    """The family's mapping table as the engines load it (its ``Family.sync_table`` where it has
    one): for a tied checkpoint whose SGLang class keeps ``lm_head`` apart
    (:func:`megarl.rollout.engine_view.needs_untied_view`), the embedding is also sent as
    ``lm_head.weight`` (``megarl.models.mapping.embedding_as_output``), so the engine's untied
    output layer stays equal to the trainer's tied embedding."""
    from megarl.models.mapping import embedding_as_output
    from megarl.rollout.engine_view import needs_untied_view

    table = family.sync_table if family.sync_table is not None else family.table
    return embedding_as_output(table) if needs_untied_view(hf_config) else table


def _hf_config_object(config: Any):
    """A ``transformers`` config (accepts both spellings of the fields) from a dict or a config."""
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        if "model_type" not in config:
            raise SpecError("config.json: missing field model_type")
        return AutoConfig.for_model(**dict(config))
    if hasattr(config, "model_type"):
        return config
    raise SpecError(f"expected a config.json dict or a transformers config, got {type(config).__name__}")


def _tp_unit(name: str, shape: tuple[int, ...], entry, layout) -> int:
    """Rows/columns of one attention query group / head: Megatron splits attention by whole heads."""
    if entry.transform.value in ("qkv", "qkv_gated"):  # per query group [q (; gate) ; k; v]
        q_rows = 2 if entry.transform.value == "qkv_gated" else 1
        return (q_rows * layout.num_attention_heads // layout.num_query_groups + 2) * layout.head_dim
    if name.endswith("self_attention.linear_proj.weight"):
        return layout.head_dim
    if name.endswith(_HEAD_ROWS):
        return shape[0] // layout.num_attention_heads
    return 1


def param_specs_from_hf_config(config: Any, *, tensor_model_parallel_size: int = 1,
                               make_vocab_size_divisible_by: int = 128,
                               dtype: str | None = None) -> list[ParamSpec]:
    """Every Megatron parameter of the model described by an HF config, in model order.

    Args:
        config: a ``config.json`` dict or a ``transformers`` config (read through ``AutoConfig``,
            so both spellings of renamed fields are accepted).
        tensor_model_parallel_size: the trainer's TP (Megatron pads the vocabulary to a
            multiple of ``make_vocab_size_divisible_by * TP``).
        make_vocab_size_divisible_by: Megatron's vocabulary padding multiple.
        dtype: parameter dtype name; default: the config's ``dtype``/``torch_dtype``, else bfloat16.

    Returns:
        Parameter specs (no tensors are allocated), named as the engines load them (:func:`engine_table`).

    Raises:
        SpecError: an unsupported ``model_type`` or HF setting (the family's message).
    """
    import torch

    from megarl.models.families import get_family
    from megarl.models.mapping import Transform, hf_names, lookup, megatron_to_hf, template_of

    hf_config = _hf_config_object(config)
    try:
        family = get_family(hf_config)
        layout = family.layout(hf_config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               tp_size=tensor_model_parallel_size)
        shapes = family.megatron_shapes(arch := family.architecture(hf_config))
    except (KeyError, ValueError, AttributeError, TypeError) as err:
        raise SpecError(f"config.json ({getattr(hf_config, 'model_type', None)}): {err}") from err
    _refuse_by_family(family, hf_config.model_type)
    _refuse_unplanned(table := engine_table(family, hf_config), hf_config.model_type)
    dtype = dtype or str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                         or "bfloat16").replace("torch.", "")
    specs, hf_shapes = [], {}  # hf_shapes: (template, shape) -> HF shapes: every layer / expert converts alike
    for name, shape in shapes.items():
        if family.sync_shard_view is not None:  # the parameter as weight sync reads it (Family.sync_table)
            shape = tuple(family.sync_shard_view(name, torch.empty(shape, device="meta")).shape)
        template, index = template_of(name)
        entry = table.get(template) or lookup(table, name)[0]  # lookup raises a named KeyError
        if entry.transform is Transform.VOCAB:
            shape = (layout.padded_vocab_size,) + tuple(shape[1:])
        key = (template, tuple(shape))
        if key not in hf_shapes:  # the family's own conversion, on a tensor without memory
            outputs = megatron_to_hf([(name, torch.empty(shape, device="meta"))], layout, table)
            hf_shapes[key] = [tuple(t.shape) for _, t in outputs]
        names = hf_names(entry, index) if hf_shapes[key] else []  # [] = not exported (tied output layer)
        param_dtype = "float32" if name.endswith(FP32_PARAMS) else dtype
        expert = index.get("E") if entry.expert else None
        sections = _engine_sections(entry, layout, tensor_model_parallel_size, name)
        hf = _hf_specs(family, layout, entry, name, zip(names, hf_shapes[key]), param_dtype, expert, sections,
                       int(arch.get("n_shared_experts") or 1))
        specs.append(ParamSpec(
            name, tuple(shape), param_dtype, _TP_AXIS[entry.tp_split.value], hf, layer=index.get("L"),
            expert=expert, first_stage=name.startswith("embedding."),
            gated=entry.tp_split.value == "glu", tp_unit=_tp_unit(name, tuple(shape), entry, layout),
            load_group=load_group(names, family.engine_load_groups)))
    return specs


def _hf_specs(family, layout, entry, name: str, named_shapes, dtype: str, expert: int | None,
              sections: tuple[int, ...], n_shared_experts: int) -> tuple[HFTensorSpec, ...]:
    """The :class:`HFTensorSpec` of each ``(HF name, shape)`` Megatron parameter ``name`` (its table
    ``entry``, ``expert`` id; the model's ``n_shared_experts``) converts to."""
    return tuple(hf_tensor(n, s, dtype, head_dim=_kv_head_rows(entry, name, layout, family.qk_norm_over_heads),
                           hf_prefix=family.hf_prefix, sections=sections if s[0] == sum(sections) else (),
                           expert=expert, expert_tp_split=entry.tp_split.value,
                           qk_norm_over_heads=family.qk_norm_over_heads, n_shared_experts=n_shared_experts)
                 for n, s in named_shapes)


def _kv_head_rows(entry, name: str, layout, qk_norm_over_heads: bool) -> int:
    """Rows per head of the parameter's ``EngineSplit.KV_HEADS`` tensors (k / v of ``linear_qkv``; the k norm
    over all heads, ``[groups * head_dim]``, :data:`_FULL_HEAD_NORMS`), else 0."""
    from megarl.models.mapping import Transform

    if entry.transform in (Transform.QKV, Transform.QKV_GATED):
        return layout.head_dim
    return layout.head_dim if qk_norm_over_heads and name.endswith("self_attention.k_layernorm.weight") else 0


def _engine_sections(entry, layout, tp: int, name: str) -> tuple[int, ...]:
    """The ``[q; k; v]`` row sections of a gated DeltaNet parameter (its ``in_proj_qkv`` / ``conv1d``
    HF tensors), () for any other; each Megatron section must split over the trainer's TP.

    Raises:
        SpecError: a section not divisible by ``tp``.
    """
    from megarl.models.mapping import TPSplit

    if entry.tp_split not in (TPSplit.GDN_IN_PROJ, TPSplit.GDN_CONV):
        return ()
    bad = [n for n in layout.tp_sections(entry.tp_split) if n % tp]
    if bad:
        raise SpecError(f"{name}: row sections {layout.tp_sections(entry.tp_split)} do not all split over "
                        f"TP {tp} (Megatron needs the DeltaNet's key and value heads divisible by TP)")
    return tuple(layout.tp_sections(TPSplit.GDN_CONV))


def _refuse_unplanned(table, model_type: str) -> None:
    """Raise :class:`SpecError` for a family whose tensors weight sync does not plan yet."""
    from megarl.models.mapping import Transform

    transforms = {e.transform for e in table.values()}
    if transforms & {Transform.TRANSPOSE, Transform.GLU_INTERLEAVED_T}:
        raise SpecError(f"config.json ({model_type}): weight sync is not planned for a table whose conversion "
                        "transposes (the copy instructions trace rows only): the family needs a sync_table with "
                        "a sync_shard_view in HF orientation, as gpt-oss has; megarl plan --no-sync plans the rest")


def load_group(hf_names: Sequence[str], groups: Sequence[Sequence[str]]) -> str | None:
    """The key of the engine load group (``Family.engine_load_groups``) one of ``hf_names`` belongs
    to: the group's first template filled with the name's layer, ``{E}`` (any expert: gpt-oss's
    stacks, one group per layer) as ``*``; None when in none."""
    for group in groups:
        for template in group:
            pattern = re.escape(template).replace(re.escape("{L}"), r"(?P<L>\d+)").replace(re.escape("{E}"), r"\d+")
            for name in hf_names:
                match = re.fullmatch(pattern, name)
                if match:
                    return group[0].replace("{E}", "*").format(**match.groupdict())
    return None


def _refuse_by_family(family, model_type: str) -> None:
    """Raise :class:`SpecError` with what the family says weight sync does not plan yet
    (``Family.weight_sync_refusal``), if anything."""
    if family.weight_sync_refusal:
        raise SpecError(f"config.json ({model_type}): weight sync is not planned yet for "
                        f"{family.weight_sync_refusal}; megarl plan --no-sync plans the rest")


def _expert_slice(hf_name: str) -> tuple[str, int | None]:
    """``megarl.models.mapping.expert_slice``: (stack name, expert) of ``stack[E]``, else (name, None)."""
    from megarl.models.mapping import expert_slice

    return expert_slice(hf_name)
