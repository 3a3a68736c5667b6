"""Parameter metadata for weight sync: Megatron parameters and the HF tensors they become.

A :class:`ParamSpec` describes one Megatron parameter in its global, unsharded form (global layer
and expert ids in the name) and the checkpoint-style Hugging Face tensors it converts to
(:class:`HFTensorSpec`), each with the way SGLang shards it over engine ranks
(:class:`EngineSplit`). Specs carry names, shapes and dtypes only: a plan for a trillion-parameter
model is built from them without allocating a byte (see :mod:`megarl.weight_sync.model_specs`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "int64": 8,
               "int32": 4, "uint8": 1}
"""Bytes per element of the dtypes weight sync moves (torch dtype names without ``torch.``)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
           "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` for ``"bfloat16"``."""
    return _DTYPES[name]


class SpecError(ValueError):
    """Parameter metadata that is inconsistent (unknown dtype, shape that does not split)."""


class EngineSplit(str, Enum):
    """How an SGLang engine of TP size ``T`` shards an HF tensor over its ranks (0.5.23 layers).

    Expert tensors use the engine's MoE TP size (``T / ep``) and only the ranks of the expert's
    EP rank receive them.
    """

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norms, router, MLA down-projections)."""
    ROWS = "rows"
    """Column-parallel linear: rank ``r`` holds rows ``chunk(T, 0)[r]`` (q heads, gate/up, MLA up-projections)."""
    COLS = "cols"
    """Row-parallel linear: rank ``r`` holds columns ``chunk(T, 1)[r]`` (o_proj, down_proj)."""
    KV_HEADS = "kv_heads"
    """k/v projections: kv-head block ``r`` if ``num_kv_heads >= T``, else head ``r * nkv // T`` (replicated)."""
    VOCAB = "vocab"
    """Vocab-parallel embedding / LM head: rows of the (64-padded) vocabulary, ``chunk(T, 0)[r]``."""
    SECTION_ROWS = "section_rows"
    """Rows in sections (:attr:`HFTensorSpec.sections`), each chunked over TP: rank ``r`` holds
    ``[s0_r; s1_r; ...]``, one row block per section (:class:`~megarl.weight_sync.engine_slices.TensorSlice`
    ``blocks``), not one block of rows at ``T > 1`` (the gated DeltaNet's ``in_proj_qkv`` / ``conv1d``,
    sections ``[q; k; v]``, ``mamba_v2_sharded_weight_loader`` and the packed ``in_proj_qkvz`` loader;
    its ``dt_bias`` / ``A_log``, one section, ``sharded_weight_loader``: ``models/qwen3_5.py``).
    SGLang's loaders narrow these even when pre-sharded: the engine side puts a rank's blocks back
    at their rows of a full-size tensor first (:func:`megarl.weight_sync.sglang_loader.unshard_sections`)."""


@dataclass(frozen=True)
class HFTensorSpec:
    """One checkpoint-style Hugging Face tensor (as in ``model.safetensors``)."""

    name: str
    """HF name, e.g. ``model.layers.3.mlp.experts.17.gate_proj.weight``."""
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without ``torch.`` (``bfloat16``, ``float32``)."""
    engine_split: EngineSplit = EngineSplit.REPLICATED
    expert: int | None = None
    """Global expert id for routed-expert tensors; None otherwise."""
    head_dim: int = 0
    """Rows per head (``EngineSplit.KV_HEADS`` only)."""
    scale_of: HFTensorSpec | None = None
    """For a block-FP8 scale (``<weight>_scale_inv``): the FP8 weight it scales; each engine rank
    holds the blocks of its slice of that weight (:mod:`megarl.weight_sync.fp8_wire`)."""
    block: tuple[int, ...] = ()
    """``(rows, cols)`` of weight per scale element (``scale_of`` only)."""
    sections: tuple[int, ...] = ()
    """Row sections (``EngineSplit.SECTION_ROWS`` only), summing to ``shape[0]``."""
    mlp_sections: int = 0
    """For an MLP projection (``gate_proj`` / ``up_proj`` / ``down_proj`` of a dense MLP, a routed or a
    shared expert): how many equal blocks its intermediate dimension (the TP-split one) is made of, each
    of which SGLang pads on CPU (:func:`~megarl.weight_sync.engine_slices.sglang_cpu_padded`): 1, or
    ``n_shared_experts`` for DeepSeek-V3 / GLM-4.5 shared experts (SGLang builds them
    ``moe_intermediate_size * n_shared_experts`` wide from the padded ``moe_intermediate_size``). 0: not
    an MLP intermediate dimension."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"{self.name}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_BYTES)})")
        if self.mlp_sections < 0:
            raise SpecError(f"{self.name}: mlp_sections must be >= 0, got {self.mlp_sections}")
        if self.scale_of is not None and len(self.block) != 2:
            raise SpecError(f"{self.name}: a block scale needs block=(rows, cols), got {self.block}")
        if self.engine_split is EngineSplit.SECTION_ROWS and sum(self.sections) != self.shape[0]:
            raise SpecError(f"{self.name}: section_rows split needs sections summing to {self.shape[0]}, "
                            f"got {self.sections}")
        kv_heads = self.engine_split is EngineSplit.KV_HEADS and self.scale_of is None  # a scale: its weight's split
        if kv_heads and (self.head_dim <= 0 or self.shape[0] % self.head_dim):
            raise SpecError(f"{self.name}: kv_heads split needs head_dim dividing {self.shape[0]}, got {self.head_dim}")

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return self.numel * self.itemsize


@dataclass(frozen=True)
class ParamSpec:
    """One Megatron parameter, global view.

    The name uses global layer and expert ids (``decoder.layers.{L}...local_experts.{E}...``) no
    matter which rank holds it; the trainer reports its shards under the same global names.
    """

    name: str
    """Global Megatron name."""
    shape: tuple[int, ...]
    """Full (unsharded) Megatron shape, vocabulary padding included."""
    dtype: str
    tp_axis: int | None
    """Axis split over TP (over ETP for expert parameters); None = replicated over TP."""
    hf: tuple[HFTensorSpec, ...]
    """The HF tensors this parameter converts to (empty: not exported, e.g. a tied output layer)."""
    layer: int | None = None
    """Global decoder layer (0-based); None for embedding, final norm and output layer."""
    expert: int | None = None
    """Global routed-expert id; None for dense parameters."""
    first_stage: bool = False
    """For ``layer is None``: lives on the first pipeline stage (embedding) instead of the last."""
    gated: bool = False
    """Megatron's gated ``linear_fc1``: each TP shard holds ``[gate_k; up_k]``, so the full tensor is
    ``[cat_k gate_k; cat_k up_k]``, not the plain concatenation of the shards."""
    tp_unit: int = 1
    """Shards hold whole units of this many rows/columns along ``tp_axis`` (attention heads, query groups)."""
    load_group: str | None = None
    """Parameters with the same key must reach the engines in one bucket: the engine's loader
    needs their HF tensors in one ``load_weights`` call (``Family.engine_load_groups``)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Family-specific conversion arguments (heads, head dim, unpadded vocabulary size)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"{self.name}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_BYTES)})")
        if self.tp_axis is not None and not 0 <= self.tp_axis < len(self.shape):
            raise SpecError(f"{self.name}: tp_axis {self.tp_axis} out of range for shape {self.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of the full (unsharded) parameter."""
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def shard_shape(self, num_shards: int) -> tuple[int, ...]:
        """Shape of one of ``num_shards`` equal shards along ``tp_axis``.

        Raises:
            SpecError: the axis does not divide.
        """
        if self.tp_axis is None or num_shards == 1:
            return self.shape
        size = self.shape[self.tp_axis]
        if size % (num_shards * self.tp_unit * (2 if self.gated else 1)):
            unit = f" of whole {self.tp_unit}-row heads/groups" if self.tp_unit > 1 else ""
            raise SpecError(f"{self.name}: axis {self.tp_axis} of {self.shape} does not split into "
                            f"{num_shards} shards{unit} (Megatron needs heads / query groups divisible by TP)")
        return self.shape[:self.tp_axis] + (size // num_shards,) + self.shape[self.tp_axis + 1:]
