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
    """Rows/columns ``[start, stop)`` along ``axis`` of an HF tensor (``axis`` None = whole tensor)."""

    axis: int | None
    start: int = 0
    stop: int = 0

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this slice of a tensor of shape ``full`` (``full`` itself when ``axis`` is None)."""
        if self.axis is None:
            return full
        return full[:self.axis] + (self.stop - self.start,) + full[self.axis + 1:]


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
        raise PlanError(f"{tensor.name}: SGLang holds rows {list(tensor.sections)} section by section on its "
                        f"{size} ranks (each rank a chunk of every section) and narrows them itself even when "
                        "pre-sharded; megarl delivers this tensor only whole at engine TP > 1 (transport "
                        "distributed, tensor or disk; auto picks distributed)")
    raise SpecError(f"{tensor.name}: unknown engine split {split!r}")
