"""Dynamic batching: sequences -> data-parallel ranks -> token-budget micro batches -> packed rows.

Plan (`plan_micro_batches`), for one optimizer step's sequences:

1. Balance the sequences over the ``dp_size`` data-parallel ranks by token count with the
   Karmarkar-Karp largest-differencing method (`karmarkar_karp`), so no rank waits on a longer one.
2. On each rank, split its sequences into micro batches of at most ``max_tokens_per_microbatch``
   tokens (again balanced with Karmarkar-Karp). Every rank runs the **same number** of micro
   batches ``M`` (the maximum over ranks): expert-parallel all-to-alls and pipeline stages pair
   micro batches across ranks. A rank with fewer sequences than ``M`` runs padding-only micro
   batches (loss mask 0). A sequence is never split (GSPO's ratio and the loss denominators are
   per sequence); one longer than the budget gets a micro batch of its own.
3. Each micro batch becomes one packed row ``[1, T_mb]`` (`pack_micro_batch`): its sequences end to
   end, padded to a multiple of ``pad_multiple`` (the TP size under sequence parallelism) or to a
   common length (``length_policy``). Attention stays within each sequence: the local (CPU) layer
   spec gets a block-diagonal causal ``attention_mask``; the Transformer Engine spec gets THD
   ``PackedSeqParams``. RoPE needs no per-sequence reset: it depends only on relative positions
   within a sequence, and the mask confines attention to those.

``padding_fraction`` = padding tokens / all tokens run, over every micro batch of every rank.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import torch
from torch import Tensor

from megarl.training.batch import TrainBatch

LENGTH_POLICIES = ("each", "across_dp", "uniform")


def karmarkar_karp(weights: Sequence[int], num_parts: int) -> list[list[int]]:
    """Partition items into ``num_parts`` sets with near-equal weight sums (largest differencing).

    Karmarkar & Karp (1982), k-way: every item starts as a k-tuple of sets (itself plus k-1 empty
    sets); repeatedly the two tuples with the largest spread (max - min sum) are merged by pairing
    the heaviest set of one with the lightest of the other, until one tuple is left.

    Args:
        weights: ``[N]`` non-negative weights (token counts).
        num_parts: k >= 1.

    Returns:
        ``num_parts`` lists of item indices (some empty if ``N < num_parts``), each sorted,
        ordered by decreasing weight sum; deterministic for equal inputs.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    heap = []
    for index, weight in enumerate(weights):
        sets = [(int(weight), [index])] + [(0, []) for _ in range(num_parts - 1)]
        heap.append((-int(weight), index, sets))  # spread = weight; index breaks ties deterministically
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie_a, a = heapq.heappop(heap)
        _, tie_b, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0], reverse=True)
        b = sorted(b, key=lambda s: s[0])
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, b)]
        sums = [w for w, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), min(tie_a, tie_b), merged))
    sets = heap[0][2] if heap else [(0, []) for _ in range(num_parts)]
    sets = sorted(sets, key=lambda s: (-s[0], s[1][:1]))
    return [sorted(items) for _, items in sets]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchSpec:
    """One micro batch of one data-parallel rank.

    Attributes:
        seq_indices: indices into the `TrainBatch` of its sequences (may be empty: padding only).
        num_tokens: real tokens (sum of the sequences' lengths).
        padded_length: length of the packed row after padding, ``>= max(num_tokens, 1)``.
    """

    seq_indices: tuple[int, ...]
    num_tokens: int
    padded_length: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """Micro batches of every data-parallel rank for one optimizer step.

    Attributes:
        micro_batches: ``[dp_size][M]`` specs; every rank has the same number ``M``.
        padding_fraction: padding tokens / all tokens run, over all ranks.
    """

    micro_batches: list[list[MicroBatchSpec]]
    padding_fraction: float

    @property
    def num_microbatches(self) -> int:
        """M, the micro batches per rank."""
        return len(self.micro_batches[0])


def _split_rank(lengths: dict[int, int], max_tokens: int, min_parts: int) -> list[list[int]]:
    """Split one rank's sequences into the fewest balanced bins of <= max_tokens (>= min_parts)."""
    total = sum(lengths.values())
    parts = max(min_parts, min(-(-total // max_tokens), len(lengths)), 1)
    items = sorted(lengths)
    while True:
        bins = karmarkar_karp([lengths[i] for i in items], parts)
        bins = [[items[j] for j in b] for b in bins]
        too_big = [b for b in bins if len(b) > 1 and sum(lengths[i] for i in b) > max_tokens]
        if not too_big or parts >= len(items):
            return bins
        parts += 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_micro_batches(seq_lens: Sequence[int], *, dp_size: int, max_tokens_per_microbatch: int | None,
                       micro_batch_size: int = 1, pad_multiple: int = 1, length_policy: str = "each") -> BatchPlan:
    """Assign sequences to data-parallel ranks and micro batches (see the module docstring).

    Args:
        seq_lens: ``[B]`` token counts of the step's sequences (prompt + response).
        dp_size: data-parallel size.
        max_tokens_per_microbatch: token budget per micro batch; None = ``micro_batch_size``
            sequences per micro batch (rank-balanced, in length order).
        micro_batch_size: sequences per micro batch when there is no token budget.
        pad_multiple: each packed row's length is rounded up to a multiple of this.
        length_policy: ``each`` (own length), ``across_dp`` (micro batch ``j`` has one length on
            every rank: the allgather MoE dispatcher needs equal token counts over EP ranks) or
            ``uniform`` (one length for every micro batch: pipeline parallelism without
            ``variable_seq_lengths``).

    Returns:
        The `BatchPlan`.

    Raises:
        ValueError: on an empty batch, fewer sequences than ``dp_size``, or a bad argument.
    """
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(f"length_policy must be one of {LENGTH_POLICIES}, got {length_policy!r}")
    if len(seq_lens) < dp_size:
        raise ValueError(f"{len(seq_lens)} sequences cannot be split over {dp_size} data-parallel ranks")
    if max_tokens_per_microbatch is not None and max_tokens_per_microbatch < 1:
        raise ValueError(f"train.max_tokens_per_microbatch must be >= 1 or None, got {max_tokens_per_microbatch}")
    lengths = {i: int(n) for i, n in enumerate(seq_lens)}
    ranks = karmarkar_karp(list(lengths.values()), dp_size)
    if max_tokens_per_microbatch is None:
        per_rank = [_chunks(sorted(r, key=lambda i: (-lengths[i], i)), micro_batch_size) for r in ranks]
    else:
        per_rank = [_split_rank({i: lengths[i] for i in r}, max_tokens_per_microbatch, 1) for r in ranks]
        num_mb = max(len(bins) for bins in per_rank)
        per_rank = [_split_rank({i: lengths[i] for i in r}, max_tokens_per_microbatch, num_mb)
                    if len(bins) < num_mb else bins for r, bins in zip(ranks, per_rank)]
    num_mb = max(len(bins) for bins in per_rank)
    per_rank = [bins + [[] for _ in range(num_mb - len(bins))] for bins in per_rank]
    tokens = [[sum(lengths[i] for i in b) for b in bins] for bins in per_rank]
    padded = [[_round_up(max(t, 1), pad_multiple) for t in row] for row in tokens]
    if length_policy == "across_dp":
        common = [max(row[j] for row in padded) for j in range(num_mb)]
        padded = [list(common) for _ in padded]
    elif length_policy == "uniform":
        longest = max(max(row) for row in padded)
        padded = [[longest] * num_mb for _ in padded]
    micro_batches = [[MicroBatchSpec(seq_indices=tuple(b), num_tokens=t, padded_length=p)
                      for b, t, p in zip(bins, trow, prow)]
                     for bins, trow, prow in zip(per_rank, tokens, padded)]
    total_run = sum(sum(row) for row in padded)
    return BatchPlan(micro_batches=micro_batches, padding_fraction=1.0 - sum(lengths.values()) / total_run)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    if size < 1:
        raise ValueError(f"train.micro_batch_size must be >= 1, got {size}")
    return [items[i:i + size] for i in range(0, len(items), size)]


@dataclasses.dataclass(kw_only=True)
class PackedMicroBatch:
    """The tensors of one packed micro batch (one row of ``T`` = ``padded_length`` tokens).

    Attributes:
        spec: the plan entry it was built from.
        input_ids: ``[1, T]`` int64; padding ids are 0.
        position_ids: ``[1, T]`` int64 position within each sequence (padding continues counting).
        attention_mask: ``[1, 1, T, T]`` bool, True = masked (block-diagonal causal), or None when
            ``packed_seq_params`` is used.
        packed_seq_params: Megatron ``PackedSeqParams`` (THD) for the Transformer Engine spec, or None.
        cu_seqlens: ``[S + 1]`` int64 boundaries of the real sequences in the row.
        token_index: ``[T_real]`` int64 positions of the row's real tokens in the `TrainBatch`'s
            packed fields (the row holds them at ``0 .. T_real - 1``).
        loss_mask: ``[T]`` bool, the batch's loss mask, False on padding.
    """

    spec: MicroBatchSpec
    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    packed_seq_params: object | None
    cu_seqlens: Tensor
    token_index: Tensor
    loss_mask: Tensor

    def gather(self, values: Tensor, pad_value: float = 0) -> Tensor:
        """``[T, ...]`` row view of a `TrainBatch` per-token field ``values [T_total, ...]``."""
        row = values[self.token_index]
        pad = self.spec.padded_length - row.shape[0]
        return torch.cat([row, torch.full((pad, *row.shape[1:]), pad_value, dtype=row.dtype)]) if pad else row


def pack_micro_batch(batch: TrainBatch, spec: MicroBatchSpec, *, use_packed_seq_params: bool = False) -> PackedMicroBatch:
    """Build the packed row of one micro batch (see `PackedMicroBatch`).

    Args:
        batch: the step's `TrainBatch`.
        spec: which sequences, and the padded length.
        use_packed_seq_params: build THD ``PackedSeqParams`` (Transformer Engine attention) instead
            of a dense block-diagonal mask (the local spec's attention only takes a mask).
    """
    token_index = batch.token_index(spec.seq_indices)
    lens = batch.seq_lens[list(spec.seq_indices)] if spec.seq_indices else torch.zeros(0, dtype=torch.int64)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    length, real = spec.padded_length, int(cu[-1])
    input_ids = torch.zeros(length, dtype=torch.int64)
    input_ids[:real] = batch.input_ids[token_index]
    loss_mask = torch.zeros(length, dtype=torch.bool)
    loss_mask[:real] = batch.loss_mask[token_index]
    # sequence id per position; padding is one extra "sequence" attending only to itself
    seq_id = torch.repeat_interleave(torch.arange(lens.numel() + 1), torch.cat([lens, torch.tensor([length - real])]))
    starts = torch.cat([cu[:-1], cu[-1:]])
    position_ids = torch.arange(length) - starts[seq_id]
    attention_mask, packed = None, None
    if use_packed_seq_params:
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = torch.cat([cu, torch.tensor([length])]) if length > real else cu
        bounds = bounds.to(torch.int32)
        max_len = int((bounds[1:] - bounds[:-1]).max())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
    else:
        same = seq_id[:, None] == seq_id[None, :]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        attention_mask = ~(same & causal)[None, None]
    return PackedMicroBatch(spec=spec, input_ids=input_ids[None], position_ids=position_ids[None],
                            attention_mask=attention_mask, packed_seq_params=packed, cu_seqlens=cu,
                            token_index=token_index, loss_mask=loss_mask)
