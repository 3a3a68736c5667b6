"""What each SGLang engine rank holds of an HF tensor: the engine layout applied to one tensor.

Dense tensors are split over the engine's TP ranks as SGLang 0.5.23's layers split them
(:class:`~megarl.weight_sync.specs.EngineSplit`); a routed expert lives on the ``moe_tp`` ranks of
its expert-parallel rank; a block-FP8 scale follows its weight's split in whole blocks. The plan
(:meth:`~megarl.weight_sync.plan.WeightSyncPlan.engine_slice`) and every transport that delivers
slices read it from here.

Engines on CPU split MLP projections over a *padded* intermediate dimension. SGLang 0.5.23's model
runner calls ``adjust_config_with_unaligned_cpu_tp`` (``model_executor/model_runner.py:1301-1304``,
``if self.device == "cpu"``) before building the model; it rounds ``moe_intermediate_size``,
``intermediate_size``, ``intermediate_size_mlp`` and ``shared_expert_intermediate_size`` up to a
multiple of ``T * 32`` (``configs/update_config.py``: ``intermediate_padding_size = tp_size *
get_moe_padding_size(...)``, ``DEFAULT_MOE_PADDING_SIZE = 32`` without a block-quantised config; a CPU
engine megarl starts serves a dequantised view, :mod:`megarl.rollout.dequantized_view`). Every rank
then holds chunk ``r`` of the padded dimension: the real rows/columns ``[r * P/T, (r + 1) * P/T)`` cut
at the real size (``narrow_padded_param_and_loaded_weight``, ``model_loader/weight_utils.py:1995``,
zeros the rest). The tiny models' ``moe_intermediate_size`` 32 becomes 64 at ``T = 2``: rank 0 holds
each expert and shared expert whole and rank 1 holds padding only, not 16 columns each. A pre-sharded
``down_proj`` half (``[H, 16]``) was refused by ``RowParallelLinear.weight_loader``'s shape assertion
(``layers/linear.py:1708``: it does not narrow or pad pre-sharded weights), which killed DeepSeek-V3's
twin at engine TP 2 on its shared expert; FusedMoE and the column-parallel linears zero-pad a narrower
slice (``layer.py:838``, ``linear.py:843``), so routed experts loaded, in another layout than a load
from disk. GPU engines (0.5.23's CUDA path) do not pad these sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError
from megarl.weight_sync.layout import EngineLayout
from megarl.weight_sync.specs import EngineSplit, HFTensorSpec, SpecError

SGLANG_VOCAB_PADDING = 64
"""SGLang 0.5.23 ``DEFAULT_VOCAB_PADDING_SIZE`` (``layers/vocab_parallel_embedding.py``)."""
SGLANG_CPU_MLP_PADDING = 32
"""SGLang 0.5.23 ``DEFAULT_MOE_PADDING_SIZE`` (``configs/update_config.py``): a CPU engine of TP ``T`` pads
MLP intermediate sizes to a multiple of ``T`` times this (module docstring)."""


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
    ranks of its expert-parallel rank and is split over those. On a CPU engine an MLP projection is
    split over its padded intermediate dimension (module docstring): a rank whose chunk is padding
    only holds nothing of it and is left out.

    Raises:
        PlanError: a dimension that does not split, a vocabulary SGLang would pad (its pre-sharded
            vocab loader accepts only ``vocab_size / T`` rows per rank), a slice of an expert stack
            at engine EP > 1, kv heads a CPU engine pads, or an MLP chunk a CPU engine holds part
            real, part padding (:func:`_padded_chunk`).
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
        held = {ep_rank * moe_tp + k: _split(tensor, moe_tp, k, layout) for k in range(moe_tp)}
    else:
        held = {r: _split(tensor, layout.tp_size, r, layout) for r in range(layout.tp_size)}
    return {r: sl for r, sl in held.items() if sl is not None}


def sglang_cpu_padded(size: int, mlp_sections: int, tp_size: int) -> int:
    """The intermediate size a CPU engine of TP ``tp_size`` builds for an MLP dimension of ``size``
    made of ``mlp_sections`` blocks (:attr:`~megarl.weight_sync.specs.HFTensorSpec.mlp_sections`): each
    block rounded up to a multiple of ``tp_size * SGLANG_CPU_MLP_PADDING`` (SGLang 0.5.23
    ``adjust_config_with_unaligned_cpu_tp``, ``configs/update_config.py:290-303``); ``size`` when
    ``mlp_sections`` is 0."""
    if mlp_sections == 0:
        return size
    unit = tp_size * SGLANG_CPU_MLP_PADDING
    return mlp_sections * -(-(size // mlp_sections) // unit) * unit


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


def _padded_chunk(tensor: HFTensorSpec, axis: int, size: int, rank: int, layout: EngineLayout) -> TensorSlice | None:
    """Rank ``rank``'s chunk of ``tensor``'s padded intermediate dimension on a CPU engine (module
    docstring), cut at the real size (the whole tensor: ``TensorSlice(None)``); None where it is padding only.

    A chunk that is part real, part padding is sent only where it is the whole tensor and SGLang's loader
    zero-pads it (the column-parallel linears with :func:`~megarl.weight_sync.sglang_compat.cpu_presharded_qkv_fix`,
    ``linear.py:843``; FusedMoE, ``fused_moe_triton/layer.py:838``: a routed expert on its first MoE-TP rank
    when the engine has EP > 1, since the padding is a multiple of ``T * 32``, not of ``T / ep * 32``).

    Raises:
        PlanError: a part-padded chunk of a dense row-parallel tensor (SGLang's ``RowParallelLinear`` asserts
            the padded shape for a pre-sharded weight, ``layers/linear.py:1708``), or one that is not the
            whole tensor (megarl's receiver takes only slices that divide the checkpoint's shape).
    """
    n = tensor.shape[axis]
    padded = sglang_cpu_padded(n, tensor.mlp_sections, layout.tp_size)
    step = padded // size  # padded is a multiple of tp_size * 32, size divides tp_size
    start, stop = min(rank * step, n), min((rank + 1) * step, n)
    if start == stop:
        return None
    if stop - start < step and (axis == 1 and tensor.expert is None or (start, stop) != (0, n)):
        why = ("SGLang 0.5.23's RowParallelLinear does not pad a pre-sharded weight (linear.py:1708 asserts the "
               "padded shape)" if axis == 1 and tensor.expert is None else
               "megarl sends a part-padded chunk only when it is the whole tensor")
        raise PlanError(f"{tensor.name}: a CPU engine of TP {layout.tp_size} pads its {n} "
                        f"{('rows', 'columns')[axis]} to {padded}, so engine rank {rank} holds [{start}, {stop}) and "
                        f"{step - (stop - start)} of zeros; {why}: this tensor goes whole (transport distributed, "
                        "tensor or disk)")
    return TensorSlice(None) if (start, stop) == (0, n) else TensorSlice(axis, start, stop)


def _split(tensor: HFTensorSpec, size: int, rank: int, layout: EngineLayout) -> TensorSlice | None:
    split = tensor.engine_split
    if split is EngineSplit.REPLICATED:
        return TensorSlice(None)
    if split in (EngineSplit.ROWS, EngineSplit.COLS) and tensor.mlp_sections and layout.device == "cpu":
        axis = 0 if split is EngineSplit.ROWS else 1
        if sglang_cpu_padded(tensor.shape[axis], tensor.mlp_sections, layout.tp_size) != tensor.shape[axis]:
            return _padded_chunk(tensor, axis, size, rank, layout)
    if size == 1:
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
        return _kv_heads(tensor, size, rank, layout)
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


def _kv_heads(tensor: HFTensorSpec, size: int, rank: int, layout: EngineLayout) -> TensorSlice:
    """kv-head block ``rank`` if the kv heads split over ``size`` ranks, else (GPU) head ``rank * nkv // size``."""
    num_kv_heads = tensor.shape[0] // tensor.head_dim
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise PlanError(f"{tensor.name}: {num_kv_heads} kv heads do not split over {size} engine ranks")
        per_rank = num_kv_heads // size
        return TensorSlice(0, rank * per_rank * tensor.head_dim, (rank + 1) * per_rank * tensor.head_dim)
    if layout.device == "cpu":  # update_config.py:244-283: heads padded to a multiple of T instead of replicated
        raise PlanError(f"{tensor.name}: a CPU engine of TP {size} pads {num_kv_heads} kv heads to {size} "
                        "(SGLang 0.5.23 adjust_config_with_unaligned_cpu_tp); megarl delivers it only whole there")
    if size % num_kv_heads:
        raise PlanError(f"{tensor.name}: {num_kv_heads} kv heads cannot be replicated over {size} ranks")
    head = rank * num_kv_heads // size
    return TensorSlice(0, head * tensor.head_dim, (head + 1) * tensor.head_dim)
