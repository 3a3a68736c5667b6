"""Context parallelism (CP): packed sequences split over ``cp_size`` ranks, losses on whole sequences.

Megatron-Core 0.16.1 runs CP only through Transformer Engine attention (``TEDotProductAttention``)
with THD packed sequences; its local ``DotProductAttention`` asserts ``context_parallel_size == 1``.
So the trainer uses this module only with the TE layer spec (CUDA).

**Token layout** (load-balanced for causal attention). One micro batch is one THD row of ``S``
tokens holding sequences end to end, each padded at its end to a multiple of ``2 * cp_size``
(`cp_padded_length`); a trailing padding segment (also a multiple of ``2 * cp_size``) fills the
row to ``S``. Each segment is cut into ``2 * cp_size`` equal chunks and CP rank ``r`` keeps chunks
``r`` and ``2 * cp_size - 1 - r`` of every segment, in row order (`partition_indices`). This is
TE's ``thd_get_partitioned_indices`` layout (``transformer_engine/common/fused_attn/
context_parallel.cu``, ``thd_partition_indices_kernel``: local token ``j`` of a segment of padded
length ``L`` starting at ``c`` is ``c + r L/(2 cp) + j`` in the first half, ``c + (2 cp - 1 - r)
L/(2 cp) + (j - L/(2 cp))`` in the second), which Megatron-LM's
``megatron.core.utils.get_thd_batch_on_this_cp_rank`` applies to the batch, and which Megatron's
THD RoPE (``rope_utils._get_thd_freqs_on_this_cp_rank``) and TE's ring attention assume.

**PackedSeqParams**: ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` are all the *padded,
full-row* boundaries (every segment divisible by ``2 * cp_size``, as TE's CP kernels and Megatron's
THD RoPE split them by ``cp_size``). Megatron-LM passes the unpadded boundaries as
``cu_seqlens_q`` and the padded ones as ``cu_seqlens_q_padded``; we count each sequence's tail
padding as part of the sequence instead: padding sits after the real tokens, so under the causal
mask no real token attends to it and the real tokens' outputs are the same (and TE never sees a
segment whose real length differs from its padded one).

**Logprobs and losses** (`cp_micro_batch_logprobs`): CP rank ``r`` holds logits only for its
local positions; position ``g`` of the full row predicts token ``g + 1`` of the *full* row (its
label may live on another CP rank: labels are taken from the full row before the split). The
``[S / cp]`` local logprobs (and entropies) are all-gathered over the CP group into the full row,
shifted to "logprob of token ``g``" and handed to the unchanged loss code, so every CP rank
computes the **whole** micro batch's loss (GSPO's per-sequence mean log-ratio, token counts and
sequence-mean aggregation see whole sequences before any nonlinearity). The gather's backward
keeps only the rank's own slice of the gradient (no sum over CP ranks): every CP rank computes the
same loss from the same gathered values, so each local logprob receives ``dL/dlogprob`` exactly
once.

**Gradient scale**: Megatron's schedule multiplies a 2-tuple ``loss_func`` result by
``cp_size / num_microbatches`` and DDP scales gradients by ``1 / (dp_size * cp_size)`` before
summing over the data-parallel-with-CP group (``dp_cp_group``). The trainer keeps multiplying the
loss by ``num_microbatches * dp_size`` with ``dp_size`` *without* CP (Megatron's
``get_data_parallel_world_size()``), so the net factor is 1 and the gradient is the sum over micro
batches and data-parallel ranks of the micro-batch losses, each counted once.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.training.batch import TrainBatch
from megarl.training.batching import MicroBatchSpec
from megarl.training.collectives import all_gather
from megarl.training.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs_and_entropy
from megarl.training.micro_batch import PackedMicroBatch


def cp_padded_length(length: int, cp_size: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp_size`` (a sequence's length in the CP row)."""
    multiple = 2 * cp_size
    return -(-length // multiple) * multiple


def cp_row_multiple(cp_size: int, local_multiple: int = 1) -> int:
    """What the full row length ``S`` must be a multiple of: ``2 * cp_size`` (every segment splits
    into ``2 * cp_size`` chunks) with ``S / cp_size`` a multiple of ``local_multiple`` (the TP size
    under sequence parallelism, times the FP8 token multiple)."""
    return cp_size * math.lcm(2, local_multiple)


def _partition_indices_torch(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    bounds = cu_seqlens_padded.to(torch.int64).cpu().tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + k * chunk, start + (k + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def partition_indices(cu_seqlens_padded: Tensor, total_tokens: int, cp_size: int, cp_rank: int, *,
                      use_te: bool | None = None) -> Tensor:
    """Positions of the full THD row that CP rank ``cp_rank`` holds, in its local order.

    Args:
        cu_seqlens_padded: ``[N + 1]`` int boundaries of the row's segments, every segment a
            multiple of ``2 * cp_size``, ``cu_seqlens_padded[-1] == total_tokens``.
        total_tokens: ``S``, the row length.
        cp_size, cp_rank: the CP group size and this rank's index in it.
        use_te: use Transformer Engine's ``thd_get_partitioned_indices`` (CUDA); None = when TE
            is importable and CUDA is available.

    Returns:
        ``[S / cp_size]`` int64 (CPU) positions: for each segment, its chunks ``cp_rank`` and
        ``2 cp_size - 1 - cp_rank`` of ``2 cp_size`` (module docstring).

    Raises:
        ValueError: a segment or ``S`` not divisible by ``2 * cp_size``, or bounds not ending at ``S``.
    """
    bounds = cu_seqlens_padded.to(torch.int64).cpu()
    lengths = bounds[1:] - bounds[:-1]
    if int(bounds[-1]) != total_tokens or bool((lengths % (2 * cp_size)).any()) or total_tokens % (2 * cp_size):
        raise ValueError(f"CP needs every THD segment and the row ({total_tokens} tokens) divisible by "
                         f"2 * context_parallel_size = {2 * cp_size}; segments {lengths.tolist()}")
    if use_te is None:
        use_te = torch.cuda.is_available() and _te_extension() is not None
    if use_te:
        tex = _te_extension()
        return tex.thd_get_partitioned_indices(bounds.to(torch.int32).cuda(), total_tokens, cp_size,
                                               cp_rank).to(torch.int64).cpu()
    return _partition_indices_torch(bounds, cp_size, cp_rank)


def _te_extension():
    try:
        import transformer_engine_torch as tex  # optional, CUDA only
    except ImportError:
        return None
    return tex if hasattr(tex, "thd_get_partitioned_indices") else None


@dataclasses.dataclass(kw_only=True)
class CPMicroBatch(PackedMicroBatch):
    """A `PackedMicroBatch` whose model inputs are this CP rank's share of one THD row.

    ``input_ids`` / ``position_ids`` are the local ``[1, S / cp]`` tokens (model inputs);
    ``packed_seq_params`` has the padded full-row boundaries; ``cu_seqlens``, ``flat_index`` and
    ``token_index`` describe the real tokens in the **full** row (flat positions ``0 .. S-1``), so
    `gather` and the loss code see the whole micro batch. ``shape`` is ``(1, S)``: Megatron's
    pipeline schedule divides the sequence length by ``cp_size`` itself.

    Attributes:
        full_length: ``S``.
        local_index: ``[S / cp]`` int64 full-row positions of the local tokens, in local order.
        all_local_index: ``[cp, S / cp]`` int64, ``local_index`` of every CP rank.
        labels: ``[1, S / cp]`` int64, the full row's token after each local position.
        cp_group: the CP process group (all-gather of the logprobs).
    """

    full_length: int
    local_index: Tensor
    all_local_index: Tensor
    labels: Tensor
    cp_group: object = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(1, S)``: the full row (Megatron's p2p shapes divide by ``cp_size``)."""
        return 1, self.full_length

    @property
    def flat_size(self) -> int:
        """``S``: positions of the full row (the size of `gather`'s output)."""
        return self.full_length

    def to(self, device: torch.device | str) -> CPMicroBatch:
        """A copy with every tensor (and the THD boundaries) on ``device``."""
        if self.input_ids.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, Tensor):
                moved[name] = value.to(device, non_blocking=True)
        assert self.packed_seq_params is not None  # CP rows are always THD
        bounds = self.packed_seq_params.cu_seqlens_q.to(device)
        moved["packed_seq_params"] = dataclasses.replace(
            self.packed_seq_params, cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
            cu_seqlens_kv_padded=bounds)
        return CPMicroBatch(**moved)

    def gather(self, values: Tensor, pad_value: float = 0) -> Tensor:
        """``[S, ...]`` full-row view of a `TrainBatch` per-token field ``values [T_total, ...]``."""
        out = torch.full((self.full_length, *values.shape[1:]), pad_value, dtype=values.dtype, device=values.device)
        out[self.flat_index.to(values.device)] = values[self.token_index.to(values.device)]
        return out

    def router_positions(self, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False) -> Tensor:
        """Full-row positions of the tokens a router on this rank sees: the local tokens, split
        over TP ranks under sequence parallelism."""
        positions = self.local_index
        if sequence_parallel and tp_size > 1:
            positions = positions.chunk(tp_size)[tp_rank]
        return positions


def pack_cp_micro_batch(batch: TrainBatch, spec: MicroBatchSpec, *, cp_rank: int, cp_size: int,
                        cp_group=None) -> CPMicroBatch:
    """Build this CP rank's share of one THD micro batch (module docstring).

    Args:
        batch: the step's `TrainBatch`.
        spec: one row; ``spec.row_length`` must hold the sequences at their `cp_padded_length`
            and be a multiple of ``2 * cp_size`` (plan with padded lengths and `cp_row_multiple`).
        cp_rank, cp_size: this rank's CP coordinates.
        cp_group: the CP process group (stored for `cp_micro_batch_logprobs`).

    Raises:
        ValueError: more than one row, or a row too short / not divisible by ``2 * cp_size``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if len(spec.rows) != 1:
        raise ValueError(f"context parallelism packs one THD row per micro batch, the spec has {len(spec.rows)}")
    length = spec.row_length
    starts, ends = batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()
    input_ids = torch.zeros(length, dtype=torch.int64)
    position_ids = torch.zeros(length, dtype=torch.int64)
    flat, tokens, lens, bounds, offset = [], [], [], [0], 0
    for i in spec.rows[0]:
        n = ends[i] - starts[i]
        padded = cp_padded_length(n, cp_size)
        if offset + padded > length:
            raise ValueError(f"THD row of {length} tokens cannot hold its sequences padded to multiples of "
                             f"{2 * cp_size}; plan with padded lengths")
        input_ids[offset:offset + n] = batch.input_ids[starts[i]:ends[i]]
        position_ids[offset:offset + padded] = torch.arange(padded)
        flat.append(torch.arange(offset, offset + n))
        tokens.append(torch.arange(starts[i], ends[i]))
        lens.append(n)
        offset += padded
        bounds.append(offset)
    if length > offset:  # trailing padding: a segment of its own
        position_ids[offset:] = torch.arange(length - offset)
        bounds.append(length)
    cu_padded = torch.tensor(bounds, dtype=torch.int32)
    all_index = torch.stack([partition_indices(cu_padded, length, cp_size, r) for r in range(cp_size)])
    local = all_index[cp_rank]
    max_len = int((cu_padded[1:] - cu_padded[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    empty = torch.zeros(0, dtype=torch.int64)
    return CPMicroBatch(spec=spec, input_ids=input_ids[local][None], position_ids=position_ids[local][None],
                        attention_mask=None, packed_seq_params=packed, cu_seqlens=cu,
                        flat_index=torch.cat(flat) if flat else empty,
                        token_index=torch.cat(tokens) if tokens else empty,
                        full_length=length, local_index=local, all_local_index=all_index,
                        labels=torch.roll(input_ids, -1)[local][None], cp_group=cp_group)


class _GatherKeepOwnGrad(torch.autograd.Function):
    """All-gather ``[n]`` over the CP group to ``[cp, n]``; backward returns this rank's row of the
    gradient only (every CP rank computes the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx, values: Tensor, group, rank: int) -> Tensor:
        parts = all_gather(values, group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.rank].contiguous(), None, None


def gather_over_cp(values: Tensor, group) -> Tensor:
    """``[cp, n]`` stack of every CP rank's ``values [n]`` (differentiable, see `_GatherKeepOwnGrad`)."""
    return _GatherKeepOwnGrad.apply(values, group, dist.get_rank(group))


def cp_micro_batch_logprobs(logits: Tensor, mb: CPMicroBatch, *, vocab_size: int, tp_group, temperature: float,
                            entropy: str) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and entropy) of the micro batch's real tokens from this CP rank's local logits.

    The CP counterpart of `megarl.training.forward.micro_batch_logprobs` (same result): next-token
    logprobs at the local positions against the full row's labels, all-gathered over the CP group
    into the full row, shifted, and the real tokens taken.

    Args:
        logits: ``[1, S / cp, V / tp]`` model output at the local positions.
        mb: the `CPMicroBatch`.
        vocab_size, tp_group, temperature, entropy: as in ``micro_batch_logprobs``.

    Returns:
        ``(logprobs, entropy)``: ``[T_real]`` float32 each (entropy None for ``"none"``), entry ``t``
        for batch token ``mb.token_index[t]``, 0 at sequence starts; identical on every CP rank.
    """
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy must be 'none', 'metric' or 'grad', got {entropy!r}")
    temperature = temperature if temperature > 0 else 1.0
    flat = logits.reshape(-1, logits.shape[-1])
    if temperature != 1.0:
        flat = flat / temperature
    labels = mb.labels.reshape(-1).to(flat.device)
    scores, ent = vocab_parallel_logprobs_and_entropy(flat, labels, vocab_size=vocab_size, tp_group=tp_group,
                                                      with_entropy=entropy == "metric")
    if entropy == "grad":
        ent = vocab_parallel_entropy(flat, vocab_size=vocab_size, tp_group=tp_group)
    inverse = torch.argsort(mb.all_local_index.reshape(-1)).to(flat.device)
    starts = mb.cu_seqlens[:-1].to(flat.device)
    flat_index = mb.flat_index.to(flat.device)

    def to_real(local: Tensor) -> Tensor:
        predicting = gather_over_cp(local, mb.cp_group).reshape(-1)[inverse]  # [S]: log p(token g + 1)
        full = torch.cat([predicting.new_zeros(1), predicting[:-1]])  # [S]: log p(token g)
        return full[flat_index].index_fill(0, starts, 0.0)

    return to_real(scores), (to_real(ent) if entropy != "none" else None)
