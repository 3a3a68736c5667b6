"""What each SGLang engine rank holds of an HF tensor: the engine layout applied to one tensor.

Dense tensors are split over the engine's TP ranks as SGLang 0.5.23's layers split them
(:class:`~megarl.weight_sync.specs.EngineSplit`); a routed expert lives on the ``moe_tp`` ranks of
its expert-parallel rank; a block-FP8 scale follows its weight's split in whole blocks. The plan
(:meth:`~megarl.weight_sync.plan.WeightSyncPlan.engine_slice`) and every transport that delivers
slices read it from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError
from megarl.weight_sync.layout import EngineLayout
from megarl.weight_sync.specs import EngineSplit, HFTensorSpec, SpecError

SGLANG_VOCAB_PADDING = 64
"""SGLang 0.5.23 ``DEFAULT_VOCAB_PADDING_SIZE`` (``layers/vocab_parallel_embedding.py``)."""


class PlanError(UserError):
    """The parameters cannot be synced with these layouts (names the parameter or tensor)."""


@dataclass(frozen=True)
class TensorSlice:
    """Rows/columns ``[start, stop)`` along ``axis`` of an HF tensor (``axis`` None = whole tensor), or
    several row blocks (``blocks``, axis 0) held back to back in that order.

    A sectioned tensor (:attr:`~megarl.weight_sync.specs.EngineSplit.SECTION_ROWS`, the gated
    DeltaNet's ``[q; k; v]``) gives engine rank ``r`` of ``T`` one block per section, ``[q_r; k_r; v_r]``;
    ``start`` / ``stop`` then span them all and are no slice of their own. Code that meets a slice
    with a placement piece goes through :meth:`meet`, which places HF rows in the slice whatever
    its blocks.
    """

    axis: int | None
    start: int = 0
    stop: int = 0
    blocks: tuple[tuple[int, int], ...] = ()
    """``[(start, stop)]`` row blocks of a sectioned slice, in the order the engine rank holds them
    (``axis`` 0); () = the one block ``[start, stop)``."""

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The ``[(start, stop)]`` blocks along ``axis`` (one unless sectioned)."""
        return self.blocks or ((self.start, self.stop),)

    @property
    def length(self) -> int:
        """Rows/columns along ``axis`` this slice holds (0 for a whole-tensor slice)."""
        return sum(b - a for a, b in self.spans())

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this slice of a tensor of shape ``full`` (``full`` itself when ``axis`` is None)."""
        if self.axis is None:
            return full
        return full[:self.axis] + (self.length,) + full[self.axis + 1:]

    def meet(self, lo: int, hi: int, name: str = "") -> tuple[int, int, int] | None:
        """The part of ``[lo, hi)`` (indices along ``axis`` of the HF tensor ``name``) this slice holds:
        ``(lo', hi', at)``, ``at`` its place in the slice along ``axis``; None when they do not meet.

        Raises:
            PlanError: ``[lo, hi)`` meets several blocks (the placement's pieces must be cut at the
                engine's section blocks: ``Placement(engine_tp_size=T)``).
        """
        out, at = [], 0
        for a, b in self.spans():
            if max(a, lo) < min(b, hi):
                out.append((max(a, lo), min(b, hi), at + max(a, lo) - a))
            at += b - a
        if len(out) > 1:
            raise PlanError(f"{name}: rows [{lo}, {hi}) fall in {len(out)} of an engine rank's section blocks "
                            f"{list(self.spans())}; build the Placement with the engine's TP (engine_tp_size)")
        return out[0] if out else None

    def take(self, tensor):
        """This slice of ``tensor`` (the whole HF tensor): a view for one block, a new tensor of the
        blocks back to back for several; ``tensor`` itself when ``axis`` is None."""
        if self.axis is None:
            return tensor
        if not self.blocks:
            return tensor.narrow(self.axis, self.start, self.stop - self.start)
        import torch

        return torch.cat([tensor.narrow(self.axis, a, b - a) for a, b in self.blocks], dim=self.axis)


def sglang_padded_vocab(vocab_size: int, tp_size: int) -> int:
    """SGLang 0.5.23's padded vocabulary (``VocabParallelEmbedding.__init__``)."""
    padding = SGLANG_VOCAB_PADDING
    padded = -(-vocab_size // padding) * padding
    if padded % tp_size:
        padding *= tp_size
        padded = -(-vocab_size // padding) * padding
    return padded


def _chunk(tensor: HFTensorSpec, axis: int, size: int, rank: int) -> TensorSlice:
    if tensor.shape[axis] % size:
        raise PlanError(f"{tensor.name}: dimension {axis} of {tensor.shape} does not split over {size} engine ranks")
    step = tensor.shape[axis] // size
    return TensorSlice(axis, rank * step, (rank + 1) * step)


def engine_slices(tensor: HFTensorSpec, layout: EngineLayout, num_experts: int) -> dict[int, TensorSlice]:
    """What each SGLang engine rank holds of ``tensor``: ``{tp_rank: slice}``, receivers only.

    Dense tensors are split over the engine's TP ranks; a routed expert lives on the ``moe_tp``
    ranks of its expert-parallel rank and is split over those.

    Raises:
        PlanError: a dimension that does not split, a vocabulary SGLang would pad (its pre-sharded
            vocab loader accepts only ``vocab_size / T`` rows per rank), or a slice of an expert stack
            at engine EP > 1.
    """
    if tensor.scale_of is not None:
        weight = tensor.scale_of
        return {r: _block_slice(tensor, weight, sl) for r, sl in engine_slices(weight, layout, num_experts).items()}
    if tensor.expert is not None:
        if tensor.name.endswith("]") and layout.ep_size > 1:
            raise PlanError(f"{tensor.name}: a slice of a stack of every expert (gpt-oss) cannot be served at engine "
                            f"expert_parallel_size {layout.ep_size}: SGLang 0.5.23's FusedMoE.weight_loader_fused "
                            "copies the whole stack into each rank's local experts (layers/moe/fused_moe_triton/"
                            "layer.py:1559, no expert id); serve it with engine TP only")
        moe_tp = layout.moe_tp_size
        ep_rank = tensor.expert // (num_experts // layout.ep_size)
        return {ep_rank * moe_tp + k: _split(tensor, moe_tp, k) for k in range(moe_tp)}
    return {r: _split(tensor, layout.tp_size, r) for r in range(layout.tp_size)}


def _block_slice(scale: HFTensorSpec, weight: HFTensorSpec, weight_slice: TensorSlice) -> TensorSlice:
    """The scale blocks of an engine rank's slice of ``weight``, the block-FP8 weight ``scale`` belongs to
    (SGLang's ``BlockQuantScaleParameter``: the weight's split, in whole blocks)."""
    if weight_slice.axis is None:
        return weight_slice
    if len(weight_slice.spans()) > 1:
        raise PlanError(f"{weight.name}: block-FP8 scales of a sectioned tensor are not planned at engine TP > 1 "
                        "(each engine rank holds several row blocks of it)")
    axis = weight_slice.axis
    b = scale.block[axis]
    if weight_slice.start % b or (weight_slice.stop % b and weight_slice.stop != weight.shape[axis]):
        raise PlanError(f"{weight.name}: an engine rank holds {('rows', 'columns')[axis]} [{weight_slice.start}, "
                        f"{weight_slice.stop}), not whole {b}-element FP8 blocks (SGLang refuses block-FP8 layers "
                        f"split like this)")
    return TensorSlice(axis, weight_slice.start // b, -(-weight_slice.stop // b))


def _split(tensor: HFTensorSpec, size: int, rank: int) -> TensorSlice:
    split = tensor.engine_split
    if split is EngineSplit.REPLICATED or size == 1:
        return TensorSlice(None)
    if split is EngineSplit.ROWS:
        return _chunk(tensor, 0, size, rank)
    if split is EngineSplit.COLS:
        return _chunk(tensor, 1, size, rank)
    if split is EngineSplit.VOCAB:
        vocab = tensor.shape[0]
        if sglang_padded_vocab(vocab, size) != vocab:
            raise PlanError(f"{tensor.name}: vocabulary {vocab} is padded by SGLang at TP {size}; pre-sharded "
                            f"delivery needs vocab_size divisible by {SGLANG_VOCAB_PADDING} and by TP")
        return _chunk(tensor, 0, size, rank)
    if split is EngineSplit.KV_HEADS:
        num_kv_heads = tensor.shape[0] // tensor.head_dim
        if num_kv_heads >= size:
            if num_kv_heads % size:
                raise PlanError(f"{tensor.name}: {num_kv_heads} kv heads do not split over {size} engine ranks")
            per_rank = num_kv_heads // size
            return TensorSlice(0, rank * per_rank * tensor.head_dim, (rank + 1) * per_rank * tensor.head_dim)
        if size % num_kv_heads:
            raise PlanError(f"{tensor.name}: {num_kv_heads} kv heads cannot be replicated over {size} ranks")
        head = rank * num_kv_heads // size
        return TensorSlice(0, head * tensor.head_dim, (head + 1) * tensor.head_dim)
    if split is EngineSplit.SECTION_ROWS:
        return _section_blocks(tensor, size, rank)
    raise SpecError(f"{tensor.name}: unknown engine split {split!r}")


def _section_blocks(tensor: HFTensorSpec, size: int, rank: int) -> TensorSlice:
    """Engine rank ``rank``'s rows of a sectioned tensor: chunk ``rank`` of every section, back to back
    (SGLang 0.5.23's ``Qwen3_5GatedDeltaNet``: ``mamba_v2_sharded_weight_loader`` for ``conv1d``, the
    merged column-parallel ``in_proj_qkvz`` for ``in_proj_qkv``, ``sharded_weight_loader(0)`` for
    ``dt_bias`` / ``A_log``; ``models/qwen3_5.py`` lines 398-487)."""
    bad = [n for n in tensor.sections if n % size]
    if bad:
        raise PlanError(f"{tensor.name}: row sections {list(tensor.sections)} do not all split over {size} engine "
                        "ranks (SGLang pads the DeltaNet's heads then; pre-sharded delivery needs them divisible)")
    blocks, offset = [], 0
    for n in tensor.sections:
        step = n // size
        blocks.append((offset + rank * step, offset + (rank + 1) * step))
        offset += n
    return TensorSlice(0, blocks[0][0], blocks[-1][1], tuple(blocks))
