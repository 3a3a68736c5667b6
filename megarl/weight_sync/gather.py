"""Trainer side of a weight sync: each stage sender assembles its buckets' HF tensors in place.

For every bucket, the sender owns one flat byte buffer laid out exactly as the engines expect it
(the bucket's HF tensors back to back, wire order). Following the copy instructions of
:mod:`megarl.weight_sync.placement` (the family mapping, traced), it

- posts receives of other ranks' shards straight into that buffer where the rows are contiguous
  (column-split shards go to a temporary first), over the trainer's process group (gloo on CPU,
  NCCL on GPU) — the source ranks send views of their live parameters, no packing copy;
- copies its own shards into the buffer (and the temporaries into their strided places).

The receives of bucket ``b + 1`` are posted before bucket ``b`` is handed to the transport, so
gathering the next bucket overlaps sending the current one. Buffers come from a ring of three:
bucket ``b + 1`` receives into the slot of ``b - 2``, which the transport finished with (before it
sends ``b - 1`` it waits until ``b - 2`` is broadcast, or loaded when the engines read the sender's
memory), so no buffer is reused while the engines may still read it. A source rank has at most ``max_in_flight`` buckets of sends open.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from megarl.training.collectives import irecv, isend
from megarl.weight_sync.placement import Placement
from megarl.weight_sync.plan import Bucket, WeightSyncPlan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
           "float8_e4m3fn": torch.float8_e4m3fn}
RING_SLOTS = 3


def torch_dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` for ``"bfloat16"``."""
    return _DTYPES[name]


@dataclass
class GatherTimings:
    """Seconds the sender spent per phase (summed over buckets)."""

    gather_s: float = 0.0
    """Blocked waiting for shards from other ranks (the rest of the gather overlaps sending)."""
    convert_s: float = 0.0
    """Placing local shards and column blocks into the buckets' buffers."""
    bytes_received: int = 0
    """Shard bytes received from other trainer ranks."""
    per_bucket: list = field(default_factory=list)


def _views(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's HF tensors as views of its flat buffer (wire order)."""
    out, offset = [], 0
    for t in bucket.hf_tensors:
        out.append((t.name, flat[offset:offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape)))
        offset += t.nbytes
    return out


class StageGatherer:
    """Runs the gather half of ``plan`` on trainer rank ``rank`` (every rank of a stage calls it).

    Args:
        plan: the sync plan.
        rank: this rank's global rank (the plan's trainer ranks are global ranks).
        local: global Megatron name -> this rank's shard.
        placement: copy instructions (:class:`~megarl.weight_sync.placement.Placement`).
        max_in_flight: buckets a source rank may have open sends for.
        group: process group containing the trainer ranks (default: the default group).
        ring: the sender's ``RING_SLOTS`` bucket buffers, to reuse across syncs (filled in place);
            None: fresh buffers. On CPU a fresh bucket-sized buffer is fresh memory from the OS
            and every page of it faults on first touch; CUDA's caching allocator reuses freed
            blocks by itself.
    """

    def __init__(self, plan: WeightSyncPlan, rank: int, local: Mapping[str, torch.Tensor], placement: Placement,
                 *, max_in_flight: int = 2, group: Optional[dist.ProcessGroup] = None,
                 ring: Optional[list[Optional[torch.Tensor]]] = None) -> None:
        self.plan, self.rank, self.local, self.placement = plan, rank, local, placement
        self.max_in_flight, self.group = max_in_flight, group
        self.timings = GatherTimings()
        if ring is not None and len(ring) != RING_SLOTS:
            raise ValueError(f"ring must hold {RING_SLOTS} slots, got {len(ring)}")
        self._ring: list[Optional[torch.Tensor]] = ring if ring is not None else [None] * RING_SLOTS

    def _messages(self, bucket: Bucket):
        """Every point-to-point message of a bucket, in the order both sides use:
        ``(source_rank, transfer, source, piece or None)``; None = the whole shard (column split)."""
        for transfer in bucket.params:
            pieces = self.placement.pieces(transfer)
            for source in transfer.sources:
                if source.trainer_rank == bucket.sender_rank:
                    continue
                mine = [p for p in pieces if p.shard == source.shard_index]
                if any(p.axis == 1 for p in mine):
                    yield source.trainer_rank, transfer, source, None
                else:
                    for piece in mine:
                        yield source.trainer_rank, transfer, source, piece

    # ------------------------------------------------------------------ source ranks
    def send_contributions(self) -> int:
        """Send this rank's shards of every bucket it does not send itself. Returns bytes sent."""
        in_flight: deque = deque()
        sent = 0
        for bucket in self.plan.buckets:
            if bucket.sender_rank == self.rank or not bucket.contributions(self.rank):
                continue
            while len(in_flight) >= self.max_in_flight:
                for work in in_flight.popleft():
                    work.wait()
            works = []
            for source_rank, transfer, _, piece in self._messages(bucket):
                if source_rank != self.rank:
                    continue
                shard = self.local[transfer.param.name].detach()
                data = shard if piece is None else shard.narrow(0, piece.src[0], piece.src[1] - piece.src[0])
                works.append(isend(data.contiguous(), bucket.sender_rank, group=self.group, tag=bucket.index))
                sent += data.numel() * data.element_size()
            in_flight.append(works)
        for works in in_flight:
            for work in works:
                work.wait()
        return sent

    # ------------------------------------------------------------------ sender
    def _slot(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        i = bucket.index % RING_SLOTS
        slot = self._ring[i]
        if slot is None or slot.numel() < bucket.nbytes or slot.device != device:
            slot = torch.empty(max(bucket.nbytes, self.plan.bucket_size_bytes), dtype=torch.uint8, device=device)
            self._ring[i] = slot
        return slot[:bucket.nbytes]

    def _post(self, bucket: Bucket, device: torch.device):
        flat = self._slot(bucket, device)
        views = _views(bucket, flat)
        first = {}
        offset = 0
        for transfer in bucket.params:
            first[transfer.param.name] = offset
            offset += len(transfer.param.hf)
        works, temps = [], []
        for source_rank, transfer, source, piece in self._messages(bucket):
            dtype = torch_dtype(transfer.param.dtype)
            if piece is None:
                buffer = torch.empty(source.shape, dtype=dtype, device=device)
                temps.append((transfer, source, buffer, first[transfer.param.name]))
            else:
                hf = views[first[transfer.param.name] + piece.hf_index][1]
                buffer = hf.narrow(0, piece.dst[0], piece.dst[1] - piece.dst[0])
            works.append(irecv(buffer, source_rank, group=self.group, tag=bucket.index))
            self.timings.bytes_received += buffer.numel() * buffer.element_size()
        return flat, views, first, works, temps

    def _place_local(self, bucket: Bucket, views, first, temps) -> None:
        for transfer, source, buffer, base in temps:
            for piece in self.placement.pieces(transfer):
                if piece.shard == source.shard_index:
                    self._copy(views[base + piece.hf_index][1], buffer, piece)
        for transfer in bucket.params:
            for source in transfer.sources:
                if source.trainer_rank != self.rank:
                    continue
                shard = self.local[transfer.param.name].detach()
                for piece in self.placement.pieces(transfer):
                    if piece.shard == source.shard_index:
                        self._copy(views[first[transfer.param.name] + piece.hf_index][1], shard, piece)

    @staticmethod
    def _copy(hf: torch.Tensor, shard: torch.Tensor, piece) -> None:
        n = piece.dst[1] - piece.dst[0]
        hf.narrow(piece.axis, piece.dst[0], n).copy_(shard.narrow(piece.axis, piece.src[0], n))

    def iter_hf_buckets(self) -> Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]], torch.Tensor]]:
        """Yield ``(bucket, [(hf_name, view)], flat)`` for each bucket this rank sends.

        ``flat`` holds the bucket's HF tensors back to back (wire order); the views point into it.
        It stays untouched until bucket ``index + RING_SLOTS`` is gathered.
        """
        mine = [b for b in self.plan.buckets if b.sender_rank == self.rank]
        device = next(iter(self.local.values())).device if self.local else torch.device("cpu")
        pending = self._post(mine[0], device) if mine else None
        for i, bucket in enumerate(mine):
            flat, views, first, works, temps = pending
            start = time.perf_counter()
            for work in works:
                work.wait()
            gathered = time.perf_counter()
            pending = self._post(mine[i + 1], device) if i + 1 < len(mine) else None
            self._place_local(bucket, views, first, temps)
            done = time.perf_counter()
            self.timings.gather_s += gathered - start
            self.timings.convert_s += done - gathered
            self.timings.per_bucket.append({"bucket": bucket.index, "gather_s": gathered - start,
                                            "convert_s": done - gathered, "bytes": bucket.nbytes})
            yield bucket, views, flat
