"""A data-parallel rank's share of one RL step: what the driver sends each rank (docs/architecture.md).

The driver cuts the step's `TrainBatch` into mini-batches of ``train.global_batch_size``
sequences (one optimizer step each) and every mini-batch over the ``dp_size`` data-parallel ranks
with the same Karmarkar-Karp partition the trainer's micro-batch planner uses
(`megarl.training.batching.dp_partition`, on the same lengths), so each rank receives exactly the
sequences it trains. A `BatchShard` carries those sequences plus the lengths of *every* sequence of
each mini-batch (``B`` integers): the planner needs them to give every rank the same number of
micro batches. The ranks of one data-parallel group (the TP / PP / CP ranks sharing a ``dp_rank``)
receive the same shard.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.training.batch import TrainBatch
from megarl.training.batching import dp_partition
from megarl.training.context_parallel import cp_padded_length


@dataclasses.dataclass(kw_only=True)
class BatchShard:
    """One data-parallel rank's sequences of one RL step, mini-batch after mini-batch.

    Attributes:
        batch: the rank's sequences (mini-batch 0's first), every field as in `TrainBatch`;
            ``routed_experts`` may be None while ``route_refs`` is set (resolved on the rank).
        mini_seq_lens: per mini-batch, ``[B_m]`` token counts of **all** its sequences (every
            rank's), in batch order: the micro-batch planner's input.
        mini_seq_indices: per mini-batch, the positions (in ``[0, B_m)``, ascending) of the
            sequences of ``batch`` that belong to it; ``batch`` holds them in this order.
        dp_rank: the data-parallel rank this shard is for; dp_size: the number of them.
        route_refs: R3 only: one entry per sequence of ``batch`` (object-store references to each
            trajectory's ``[P + R, L, K]`` routes, or tensors), resolved by the rank; else None.
    """

    batch: TrainBatch
    mini_seq_lens: list[list[int]]
    mini_seq_indices: list[list[int]]
    dp_rank: int
    dp_size: int
    route_refs: list[Any] | None = None

    @property
    def num_minis(self) -> int:
        """Mini-batches (optimizer steps) of the step."""
        return len(self.mini_seq_lens)

    def view(self, index: int) -> StepView:
        """Mini-batch ``index``'s `StepView` of this shard."""
        return StepView(tuple(self.mini_seq_lens[index]), tuple(self.mini_seq_indices[index]))

    def mini(self, index: int) -> TrainBatch:
        """This rank's sequences of mini-batch ``index`` (a `TrainBatch` view of ``batch``).

        Raises:
            IndexError: no such mini-batch.
        """
        if not 0 <= index < self.num_minis:
            raise IndexError(f"mini-batch {index} of a step with {self.num_minis}")
        start = sum(len(s) for s in self.mini_seq_indices[:index])
        return self.batch.select(range(start, start + len(self.mini_seq_indices[index])))


@dataclasses.dataclass(frozen=True)
class StepView:
    """Where a rank's shard sits in its optimizer step (what the micro-batch planner needs).

    Attributes:
        seq_lens: ``[B]`` token counts of every sequence of the step (all ranks), batch order.
        seq_indices: the positions in ``[0, B)`` of the shard's sequences, in the shard's order.
    """

    seq_lens: tuple[int, ...]
    seq_indices: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole step (all ranks)."""
        return sum(self.seq_lens)


def mini_batches(num_sequences: int, global_batch_size: int) -> list[range]:
    """Consecutive ranges of ``global_batch_size`` sequences (the last may be smaller): one
    optimizer step each; a group's trajectories stay adjacent.

    Raises:
        ValueError: ``train.global_batch_size`` < 1.
    """
    if global_batch_size < 1:
        raise ValueError(f"train.global_batch_size must be >= 1, got {global_batch_size}")
    return [range(i, min(i + global_batch_size, num_sequences)) for i in range(0, num_sequences, global_batch_size)]


def shard_batch(batch: TrainBatch, *, dp_size: int, global_batch_size: int, cp_size: int = 1,
                route_refs: list[Any] | None = None) -> list[BatchShard]:
    """Cut a step's batch into one `BatchShard` per data-parallel rank.

    Args:
        batch: the whole step (``B`` sequences).
        dp_size: data-parallel ranks (``ParallelState.dp_size``).
        global_batch_size: ``train.global_batch_size``, sequences per optimizer step.
        cp_size: context-parallel size: the planner balances CP-padded lengths.
        route_refs: ``B`` R3 route references (one per sequence of ``batch``), or None.

    Returns:
        ``dp_size`` shards, rank order.

    Raises:
        ValueError: a mini-batch has fewer sequences than ``dp_size`` (``train.global_batch_size``
            or the batch is too small), or ``route_refs`` has the wrong length.
    """
    if route_refs is not None and len(route_refs) != batch.num_sequences:
        raise ValueError(f"{len(route_refs)} route references for {batch.num_sequences} sequences")
    lens = batch.seq_lens.tolist()
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    mini_lens, mini_indices = list[list[int]](), [list[list[int]]() for _ in range(dp_size)]
    for rng in mini_batches(batch.num_sequences, global_batch_size):
        seq_lens = [lens[i] for i in rng]
        if len(seq_lens) < dp_size:
            raise ValueError(f"a mini-batch of {len(seq_lens)} sequences cannot be split over {dp_size} data-parallel "
                             f"ranks: raise train.global_batch_size or the rollout batch")
        parts = dp_partition([cp_padded_length(n, cp_size) if cp_size > 1 else n for n in seq_lens], dp_size)
        mini_lens.append(seq_lens)
        for rank, part in enumerate(parts):
            mini_indices[rank].append(part)
            per_rank[rank].extend(rng.start + j for j in part)
    return [BatchShard(batch=batch.select(seqs), mini_seq_lens=mini_lens, mini_seq_indices=mini_indices[rank],
                       dp_rank=rank, dp_size=dp_size,
                       route_refs=None if route_refs is None else [route_refs[i] for i in seqs])
            for rank, seqs in enumerate(per_rank)]


def with_routes(shard: BatchShard, routes: list[torch.Tensor | None]) -> BatchShard:
    """The shard with ``batch.routed_experts`` packed from resolved per-sequence routes.

    Args:
        routes: one ``[L_i, L, K]`` int32 tensor per sequence of ``shard.batch`` (None: routes
            freely, ``-1`` rows: a trajectory that never reached an engine).

    Raises:
        ValueError: a tensor's row count differs from its sequence's length.
    """
    lens = shard.batch.seq_lens.tolist()
    known = next((r for r in routes if r is not None), None)
    if known is None:
        return dataclasses.replace(shard, route_refs=None)
    parts = []
    for i, (n, r) in enumerate(zip(lens, routes)):
        if r is None:
            r = torch.full((n, *known.shape[1:]), -1, dtype=torch.int32)
        if r.shape[0] != n:
            raise ValueError(f"sequence {i} of the shard has {n} tokens but its routed_experts {r.shape[0]} rows")
        parts.append(r.to(torch.int32))
    return dataclasses.replace(shard, batch=shard.batch.replace(routed_experts=torch.cat(parts)), route_refs=None)
