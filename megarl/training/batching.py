"""Dynamic batching: sequences -> data-parallel ranks -> token-budget micro batches -> packed rows.

Plan (`plan_micro_batches`), for one optimizer step's sequences:

1. Balance the sequences over the ``dp_size`` data-parallel ranks by token count with the
   Karmarkar-Karp largest-differencing method (`karmarkar_karp`), so no rank waits on a longer one.
2. On each rank, split its sequences into micro batches of at most ``max_tokens_per_microbatch``
   real tokens and pack each into ``R`` rows of ``S`` tokens (`MicroBatchSpec.rows`), several
   sequences end to end per row, each row padded to ``S`` (a multiple of ``pad_multiple``: the TP
   size under sequence parallelism). A sequence is never split (GSPO's ratio and the loss
   denominators are per sequence); one longer than the budget gets a micro batch of its own.

   - ``pack_rows=True`` (the local layer spec, CPU): its attention is dense (``[R, heads, S, S]``
     scores under a block-diagonal causal mask), so rows are as short as the longest sequence
     they must hold; of two plans (similar-length runs, or first-fit-decreasing rows as long as
     the rank's longest sequence) the one running fewer tokens is kept (`_rank_micro_batches`).
   - ``pack_rows=False`` (Transformer Engine, THD): one row per micro batch, Karmarkar-Karp
     balanced; TE's varlen attention never computes across ``cu_seqlens`` boundaries.

3. Every rank runs the **same number** of micro batches ``M`` (expert-parallel all-to-alls and
   pipeline stages pair micro batches across ranks): the biggest micro batches are split, and a
   rank with fewer sequences than ``M`` runs padding-only micro batches (loss mask 0).
   ``length_policy`` can force one shape on every rank (``across_dp``: the allgather MoE
   dispatcher needs equal token counts over EP ranks) or on every micro batch (``uniform``:
   pipeline parallelism without ``variable_seq_lengths``) by raising ``S`` and adding empty rows.

``padding_fraction`` = padding tokens / all tokens run (``sum R S``), over every rank.
`megarl.training.micro_batch` turns a spec into tensors.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

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


def dp_partition(seq_lens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Which sequences each data-parallel rank trains: Karmarkar-Karp over token counts.

    The one partition of an optimizer step: the driver cuts the ranks' shards with it
    (`megarl.training.shard.shard_batch`) and `plan_micro_batches` plans each rank's micro batches
    from it, so a rank's shard is exactly its part of the plan.

    Args:
        seq_lens: ``[B]`` token counts (CP-padded under context parallelism).
        dp_size: data-parallel size.

    Returns:
        ``dp_size`` ascending lists of sequence indices, rank order.
    """
    return karmarkar_karp(seq_lens, dp_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchSpec:
    """One micro batch of one data-parallel rank, packed into ``R`` rows of ``S`` tokens.

    Attributes:
        rows: ``R`` tuples of sequence indices (into the `TrainBatch`) packed end to end per row;
            a row may be empty (padding only), and so may every row (a padding-only micro batch).
        row_length: ``S``, tokens per row after padding.
        num_tokens: real tokens (sum of the sequences' lengths).
    """

    rows: tuple[tuple[int, ...], ...]
    row_length: int
    num_tokens: int

    @property
    def seq_indices(self) -> tuple[int, ...]:
        """The sequences in packed (row-major) order."""
        return tuple(i for row in self.rows for i in row)

    @property
    def padded_tokens(self) -> int:
        """``R * S``, the tokens the model runs."""
        return len(self.rows) * self.row_length


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


def _sorted_runs(lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of the length-sorted (longest first) sequences, each within ``max_tokens``."""
    parts: list[list[int]] = []
    tokens = 0
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if not parts or tokens + lengths[i] > max_tokens:
            parts.append([])
            tokens = 0
        parts[-1].append(i)
        tokens += lengths[i]
    return parts


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pack_rows(seqs: list[int], lengths: dict[int, int], capacity: int) -> list[tuple[int, ...]]:
    """First-fit-decreasing bin packing of sequences into rows of ``capacity`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(seqs, key=lambda i: (-lengths[i], i)):
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            rows.append([])
            free.append(capacity)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= lengths[i]
    return [tuple(row) for row in rows] or [()]


Shape = tuple[list[tuple[int, ...]], int]
"""A micro batch as ``(rows, row_length)``."""


def _fit(rows: list[tuple[int, ...]], lengths: dict[int, int], multiple: int) -> Shape:
    """Rows with the shortest valid row length (the fullest row, rounded up)."""
    fill = max((sum(lengths[i] for i in row) for row in rows), default=0)
    return list(rows), _round_up(max(fill, 1), multiple)


def _rank_micro_batches(lengths: dict[int, int], *, max_tokens: int | None, micro_batch_size: int,
                        pack_rows: bool, multiple: int) -> list[Shape]:
    """One rank's micro batches before the counts are equalised over ranks.

    With row packing two plans are built and the one running fewer tokens (then: less attention
    work, ``sum R S^2``) is kept: (a) runs of similar lengths, rows as long as each run's
    longest sequence; (b) every sequence first-fit-decreasing into rows as long as the rank's
    longest, the rows then grouped into micro batches under the budget. (a) wins when lengths vary
    little within runs; (b) when long and short sequences can share rows.
    """
    if not lengths:
        return []
    if max_tokens is None:
        bins = _chunks(sorted(lengths, key=lambda i: (-lengths[i], i)), micro_batch_size)
        return [_fit(_pack_rows(b, lengths, _round_up(max(lengths[i] for i in b), multiple)) if pack_rows
                     else [tuple(b)], lengths, multiple) for b in bins]
    if not pack_rows:
        return [_fit([tuple(sorted(b))], lengths, multiple) for b in _split_rank(lengths, max_tokens, 1)]
    runs = [_fit(_pack_rows(b, lengths, _round_up(max(lengths[i] for i in b), multiple)), lengths, multiple)
            for b in _sorted_runs(lengths, max_tokens)]
    rows = _pack_rows(list(lengths), lengths, _round_up(max(lengths.values()), multiple))
    grouped: list[list[tuple[int, ...]]] = []
    tokens = 0
    for row in sorted(rows, key=lambda r: -sum(lengths[i] for i in r)):
        fill = sum(lengths[i] for i in row)
        if not grouped or tokens + fill > max_tokens:
            grouped.append([])
            tokens = 0
        grouped[-1].append(row)
        tokens += fill
    global_rows = [_fit(g, lengths, multiple) for g in grouped]
    cost = lambda plan: (sum(len(r) * s for r, s in plan), sum(len(r) * s * s for r, s in plan))  # noqa: E731
    return min((runs, global_rows), key=cost)


def _equalize(plan: list[Shape], count: int, lengths: dict[int, int], multiple: int) -> list[Shape]:
    """Split the biggest micro batches (then add padding-only ones) until there are ``count``."""
    plan = list(plan)
    while len(plan) < count:
        tokens = [sum(lengths[i] for row in rows for i in row) for rows, _ in plan]
        j = max(range(len(plan)), key=lambda k: (len(plan[k][0]), tokens[k])) if plan else None
        if j is not None and len(plan[j][0]) > 1:
            rows = plan[j][0]
            halves = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
        elif j is not None and len(plan[j][0][0]) > 1:
            seqs = plan[j][0][0]
            halves = [[seqs[:len(seqs) // 2]], [seqs[len(seqs) // 2:]]]
        else:
            plan.append(([()], multiple))
            continue
        plan[j:j + 1] = [_fit(h, lengths, multiple) for h in halves]
    return plan


def plan_micro_batches(seq_lens: Sequence[int], *, dp_size: int, max_tokens_per_microbatch: int | None,
                       micro_batch_size: int = 1, pad_multiple: int = 1, length_policy: str = "each",
                       pack_rows: bool = True, microbatch_multiple: int = 1) -> BatchPlan:
    """Assign sequences to data-parallel ranks, micro batches and packed rows (module docstring).

    Args:
        seq_lens: ``[B]`` token counts of the step's sequences (prompt + response).
        dp_size: data-parallel size.
        max_tokens_per_microbatch: token budget per micro batch; None = ``micro_batch_size``
            sequences per micro batch (in length order).
        micro_batch_size: sequences per micro batch when there is no token budget.
        pad_multiple: the row length is a multiple of this.
        length_policy: ``each``, ``across_dp`` (micro batch ``j`` has one shape on every rank)
            or ``uniform`` (one shape for every micro batch of every rank).
        pack_rows: several rows per micro batch (local spec) instead of a single row (THD).
        microbatch_multiple: the number of micro batches is a multiple of this (Megatron's
            interleaved pipeline schedule needs a multiple of the pipeline size).

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
    if micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size must be >= 1, got {micro_batch_size}")
    lengths = {i: int(n) for i, n in enumerate(seq_lens)}
    ranks = [{i: lengths[i] for i in r} for r in dp_partition(list(lengths.values()), dp_size)]
    shapes = [_rank_micro_batches(r, max_tokens=max_tokens_per_microbatch, micro_batch_size=micro_batch_size,
                                  pack_rows=pack_rows, multiple=pad_multiple) for r in ranks]
    num_mb = _round_up(max(len(plan) for plan in shapes), microbatch_multiple)
    shapes = [_equalize(plan, num_mb, r, pad_multiple) for plan, r in zip(shapes, ranks)]
    if length_policy == "across_dp":
        for j in range(num_mb):
            num_rows, row_length = max(len(p[j][0]) for p in shapes), max(p[j][1] for p in shapes)
            for plan in shapes:
                plan[j] = (plan[j][0] + [()] * (num_rows - len(plan[j][0])), row_length)
    elif length_policy == "uniform":
        num_rows = max(len(rows) for plan in shapes for rows, _ in plan)
        row_length = max(s for plan in shapes for _, s in plan)
        shapes = [[(rows + [()] * (num_rows - len(rows)), row_length) for rows, _ in plan] for plan in shapes]
    micro_batches = [[MicroBatchSpec(rows=tuple(rows), row_length=row_length,
                                     num_tokens=sum(lengths[i] for row in rows for i in row))
                      for rows, row_length in plan] for plan in shapes]
    total_run = sum(mb.padded_tokens for rank in micro_batches for mb in rank)
    return BatchPlan(micro_batches=micro_batches, padding_fraction=1.0 - sum(lengths.values()) / total_run)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    if size < 1:
        raise ValueError(f"train.micro_batch_size must be >= 1, got {size}")
    return [items[i:i + size] for i in range(0, len(items), size)]
