"""Megatron parameter specs from a Hugging Face ``config.json`` (metadata only, any model size).

``param_specs_from_hf_config(config)`` lists every Megatron-Core parameter of the model with its
full shape, TP split axis and the checkpoint-style HF tensors it converts to, without allocating:
names and shapes come from the family's ``Family.megatron_shapes`` (``megarl.models.families``:
qwen3, qwen3_moe, deepseek_v3, glm4_moe, ...), the TP split from its mapping table, and the HF
names and shapes from running the family's own ``megatron_to_hf`` on ``meta`` tensors (no memory).

How SGLang shards each HF tensor (:class:`EngineSplit`) follows from the tensor's module name
(:func:`engine_split_for`); that is SGLang knowledge (0.5.23 model definitions), not the trainer's.
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
_MLP = ("gate_proj", "up_proj", "down_proj")
"""MLP projections: their intermediate dimension is what a CPU engine pads (:func:`mlp_sections`)."""
_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")
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
FP32_PARAMS = ("mlp.router.expert_bias",)
"""Megatron keeps these in fp32 whatever the model dtype (the router's expert-bias buffer)."""


def engine_split_for(hf_name: str, hf_prefix: str = "") -> EngineSplit:
    """How SGLang 0.5.23 shards the HF tensor ``hf_name`` over TP ranks (by its module name);
    ``hf_prefix``: the family's ``Family.hf_prefix`` (Kimi-K2.5's ``language_model.``)."""
    if hf_name.startswith((hf_prefix + "model.embed_tokens.", hf_prefix + "lm_head.")):
        return EngineSplit.VOCAB
    if ".linear_attn." in hf_name:
        tail = hf_name.split(".linear_attn.", 1)[1].split(".")[0]
        return _LINEAR_ATTN.get(tail, EngineSplit.REPLICATED)
    parts = hf_name.rsplit(".", 2)
    module = parts[-2] if len(parts) == 3 else ""
    if module in _ROWS:
        return EngineSplit.ROWS
    if module in _COLS:
        return EngineSplit.COLS
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
              sections: tuple[int, ...] = (), n_shared_experts: int = 1) -> HFTensorSpec:
    """An :class:`HFTensorSpec` whose engine split, expert id and MLP sections (:func:`mlp_sections`, with
    the model's ``n_shared_experts``) follow from its name; ``sections``: the row sections of an
    ``EngineSplit.SECTION_ROWS`` tensor (default: one, all its rows)."""
    match = _EXPERT_RE.search(name)
    split = engine_split_for(name, hf_prefix)
    return HFTensorSpec(name, tuple(shape), dtype, split, int(match.group(1)) if match else None,
                        head_dim if split is EngineSplit.KV_HEADS else 0,
                        sections=(sections or (shape[0],)) if split is EngineSplit.SECTION_ROWS else (),
                        mlp_sections=mlp_sections(name, n_shared_experts))


def engine_table(family, hf_config) -> Mapping:
    """The family's mapping table as the engines load it: for a tied checkpoint whose SGLang class
    keeps ``lm_head`` apart (:func:`megarl.rollout.engine_view.needs_untied_view`), the embedding is
    also sent as ``lm_head.weight`` (``megarl.models.mapping.embedding_as_output``), so the engine's
    untied output layer stays equal to the trainer's tied embedding."""
    from megarl.models.mapping import embedding_as_output
    from megarl.rollout.engine_view import needs_untied_view

    return embedding_as_output(family.table) if needs_untied_view(hf_config) else family.table


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
    _refuse_unplanned(family.table, hf_config.model_type)
    dtype = dtype or str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                         or "bfloat16").replace("torch.", "")
    specs, hf_shapes = [], {}  # hf_shapes: (template, shape) -> HF shapes: every layer / expert converts alike
    table = engine_table(family, hf_config)
    for name, shape in shapes.items():
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
        head_dim = layout.head_dim if entry.transform in (Transform.QKV, Transform.QKV_GATED) else 0
        pairs = zip(names, hf_shapes[key])
        sections = _engine_sections(entry, layout, tensor_model_parallel_size, name)
        hf = tuple(hf_tensor(n, s, param_dtype, head_dim=head_dim, hf_prefix=family.hf_prefix,
                             sections=sections if s[0] == sum(sections) else (),
                             n_shared_experts=int(arch.get("n_shared_experts") or 1)) for n, s in pairs)
        specs.append(ParamSpec(
            name, tuple(shape), param_dtype, _TP_AXIS[entry.tp_split.value], hf, layer=index.get("L"),
            expert=index.get("E") if entry.expert else None, first_stage=name.startswith("embedding."),
            gated=entry.tp_split.value == "glu", tp_unit=_tp_unit(name, tuple(shape), entry, layout),
            load_group=load_group(names, family.engine_load_groups)))
    return specs


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
        raise SpecError(f"config.json ({model_type}): weight sync is not planned yet for HF tensors "
                        "stacked over experts in x @ W orientation (SGLang loads gpt-oss's experts.gate_up_proj as "
                        "a layer's whole stack, megarl sends one per expert); megarl plan --no-sync plans the rest")
    outside = sorted(name for e in table.values() if e.expert for name in e.hf if ".mlp.experts." not in name)
    if outside:  # MiniMax-M2's block_sparse_moe.experts.{E}.w1: the specs would make them replicated dense tensors
        raise SpecError(f"config.json ({model_type}): weight sync is not planned yet for experts outside "
                        f"'mlp.experts.' ({outside[0]}: the plan would send them as replicated tensors without "
                        "an expert id); megarl plan --no-sync plans the rest")
    if Transform.DSA_INDEXER_ROPE in transforms:
        raise SpecError(f"config.json ({model_type}): weight sync is not planned yet for DeepSeek Sparse Attention's "
                        "indexer (its wq_b / wk / k_norm rows are permuted per head on conversion, and SGLang "
                        "0.5.23 serves the indexer with CUDA-only kernels: no CPU load proof); megarl plan --no-sync "
                        "plans the rest")


def load_group(hf_names: Sequence[str], groups: Sequence[Sequence[str]]) -> str | None:
    """The key of the engine load group (``Family.engine_load_groups``) one of ``hf_names`` belongs
    to: the group's first template filled with the name's layer; None when in none."""
    for group in groups:
        for template in group:
            pattern = re.escape(template).replace(re.escape("{L}"), r"(?P<L>\d+)")
            for name in hf_names:
                match = re.fullmatch(pattern, name)
                if match:
                    return group[0].format(**match.groupdict())
    return None
