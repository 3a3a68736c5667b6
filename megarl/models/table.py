"""The vocabulary of a mapping table: :class:`Entry` rows, their :class:`Transform` and
:class:`TPSplit`, and the :class:`ModelLayout` dimensions a table is read with.

A leaf module: the family modules (``megarl.models.families``) build their tables from these
types, and :mod:`megarl.models.mapping` interprets the tables (and looks families up); neither
imports the other at module level through this file, so there is no import cycle.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Transform(str, enum.Enum):
    """How the HF tensors of one entry become the full Megatron tensor."""

    COPY = "copy"
    """One HF tensor, identical."""
    QKV = "qkv"
    """HF ``[q, k, v]`` projections interleaved per query group into ``linear_qkv``."""
    GLU = "glu"
    """HF ``[gate, up]`` concatenated along rows into ``linear_fc1``."""
    VOCAB = "vocab"
    """One HF ``[V, H]`` tensor, rows zero-padded to the padded vocabulary (to HF: one copy per name
    of the entry, ``mapping.embedding_as_output``)."""
    GLU_INTERLEAVED_T = "glu_interleaved_t"
    """One HF ``[H, 2F]`` tensor (``x @ W`` layout) whose columns alternate gate, up (gpt-oss's
    ``gate_up_proj``), or its ``[2F]`` bias, into ``linear_fc1``'s ``[gate; up]`` rows ``[2F, H]``."""
    TRANSPOSE = "transpose"
    """One HF ``[F, H]`` tensor (``x @ W`` layout, gpt-oss's ``down_proj``), transposed to ``[H, F]``."""


class TPSplit(str, enum.Enum):
    """How a full Megatron tensor is split over its tensor-parallel group."""

    NONE = "none"
    """Replicated on every TP rank (norms, router)."""
    COLUMN = "column"
    """Rows (dim 0) split into equal contiguous chunks (column-parallel linear, vocab)."""
    ROW = "row"
    """Columns (dim 1) split into equal chunks (row-parallel linear)."""
    GLU = "glu"
    """Column-parallel GLU ``[gate; up]``: each rank holds ``[gate_r; up_r]``."""


@dataclass(frozen=True)
class Entry:
    """One row of a family's mapping table."""

    hf: tuple[str, ...]
    """HF name templates (``{L}`` layer, ``{E}`` expert), in the transform's argument order. A name
    ending in ``[{E}]`` is expert E's slice (dim 0) of one tensor stacking every expert of the layer
    (gpt-oss's ``mlp.experts.gate_up_proj``): :func:`megarl.models.mapping.megatron_to_hf` stacks
    the slices and the HF reader reads one slice."""
    transform: Transform
    tp_split: TPSplit
    expert: bool = False
    """Expert weight: sharded by expert parallelism and split over the expert-TP group (ETP)."""


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """The dimensions the mapping needs, from the HF config (see ``families``)."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    """HF vocabulary size (``config.vocab_size``); exported embeddings have exactly this many rows."""
    padded_vocab_size: int
    """Megatron's padded vocabulary (multiple of make_vocab_size_divisible_by x TP)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True = MoE MLP, False = dense MLP."""
    tie_word_embeddings: bool = False


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp_size``."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
