"""The vocabulary of a mapping table: :class:`Entry` rows, their :class:`Transform` and
:class:`TPSplit`, and the :class:`ModelLayout` dimensions a table is read with.

A leaf module: the family modules (``megarl.models.families``) build their tables from these
types, and :mod:`megarl.models.mapping` interprets the tables (and looks families up); neither
imports the other at module level through this file, so there is no import cycle.

A transform only one family needs is that family's: its module declares a :class:`FamilyTransform`
(the two functions) and its table's entries carry it, so adding it edits neither this file nor
:mod:`megarl.models.mapping` (DeepSeek-V3.2's indexer rope rows, ``families/deepseek_v32.py``).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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
    QKV_GATED = "qkv_gated"
    """Gated attention (Qwen3.5): HF ``q_proj`` rows hold per head ``[q_h; gate_h]``, with ``k_proj``
    and ``v_proj`` interleaved per query group into ``linear_qkv`` rows ``[q_g; gate_g; k_g; v_g]``
    (``attention_output_gate``, Megatron-Core 0.16.1 ``attention.py`` ``get_query_key_value_tensors``)."""
    GDN_IN_PROJ = "gdn_in_proj"
    """Gated DeltaNet input projection (Qwen3.5): HF ``in_proj_qkv [2K+V, H]``, ``in_proj_z [V, H]``,
    ``in_proj_b [Hv, H]``, ``in_proj_a [Hv, H]`` concatenated along rows into ``in_proj``
    (``K``/``V``: key/value dims of all heads, ``Hv`` value heads; ``ssm/gated_delta_net.py``)."""


@dataclass(frozen=True)
class FamilyTransform:
    """A transform one family declares in its own module, carried by its table's :class:`Entry` rows;
    :func:`megarl.models.mapping.to_megatron` / :func:`~megarl.models.mapping.to_hf` call its functions.
    Tensors are ``torch.Tensor``; the functions are module-level (an entry is pickled by reference)."""

    value: str
    """Its name, distinct from every :class:`Transform` value and every other family's (what code that
    reads ``entry.transform.value`` sees; ``tests/unit/models/test_family_room.py`` checks both)."""
    to_megatron: Callable[[Sequence[Any], ModelLayout], Any]
    """``(HF tensors in entry.hf order, layout) -> full Megatron tensor``."""
    to_hf: Callable[[Any, ModelLayout], list[Any]]
    """``(full Megatron tensor, layout) -> HF tensors in entry.hf order``; the inverse of :attr:`to_megatron`."""


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
    GDN_IN_PROJ = "gdn_in_proj"
    """Gated DeltaNet ``in_proj`` rows ``[q; k; v; z; beta; alpha]`` (sizes ``K, K, V, V, Hv, Hv`` of
    the :class:`ModelLayout`): each rank holds ``[q_r; k_r; v_r; z_r; beta_r; alpha_r]``."""
    GDN_CONV = "gdn_conv"
    """Gated DeltaNet ``conv1d`` channels ``[q; k; v]`` (sizes ``K, K, V``): each rank ``[q_r; k_r; v_r]``."""


@dataclass(frozen=True)
class Entry:
    """One row of a family's mapping table."""

    hf: tuple[str, ...]
    """HF name templates (``{L}`` layer, ``{E}`` expert), in the transform's argument order. A name
    ending in ``[{E}]`` is expert E's slice (dim 0) of one tensor stacking every expert of the layer
    (gpt-oss's ``mlp.experts.gate_up_proj``): :func:`megarl.models.mapping.megatron_to_hf` stacks
    the slices and the HF reader reads one slice."""
    transform: Transform | FamilyTransform
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
    linear_key_dim: int = 0
    """Gated DeltaNet: key (and query) dim over all key heads (0: no linear-attention layers)."""
    linear_value_dim: int = 0
    """Gated DeltaNet: value (and output gate) dim over all value heads."""
    linear_value_heads: int = 0
    """Gated DeltaNet: value heads (rows of ``beta`` and ``alpha``)."""
    index_head_dim: int = 0
    """DSA indexer: head dim of its queries and key (0: no indexer)."""
    index_rope_dim: int = 0
    """DSA indexer: rotated dims of each head (the model's ``qk_rope_head_dim``)."""

    def tp_sections(self, split: TPSplit) -> list[int]:
        """Row sections of a sectioned split (:attr:`TPSplit.GDN_IN_PROJ`, :attr:`TPSplit.GDN_CONV`),
        each split over TP on its own.

        Raises:
            ValueError: the layout has no linear-attention dimensions, or ``split`` is not sectioned.
        """
        k, v, heads = self.linear_key_dim, self.linear_value_dim, self.linear_value_heads
        if not (k and v and heads):
            raise ValueError(f"{self.family}: TP split {split.value} needs the layout's linear-attention dims")
        if split is TPSplit.GDN_IN_PROJ:
            return [k, k, v, v, heads, heads]
        if split is TPSplit.GDN_CONV:
            return [k, k, v]
        raise ValueError(f"TP split {split.value} has no sections")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp_size``."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
