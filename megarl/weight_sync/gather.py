"""Trainer side of a weight sync: each stage sender assembles its buckets' HF tensors in place.

For every bucket, the sender owns one flat byte buffer laid out exactly as the engines expect it
(the bucket's HF tensors back to back, wire order). Following the copy instructions of
:mod:`megarl.weight_sync.placement` (the family mapping, traced), it

- posts receives of other ranks' shards straight into that buffer where the rows are contiguous
  (column-split shards go to a temporary first), over the trainer's process group (gloo on CPU,
  NCCL on GPU) — the source ranks send views of their live parameters, no packing copy;
- copies its own shards into the buffer (and the temporaries into their strided places).

With ``sliced=True`` (the ``p2p`` transport, engines not serving FP8) the flat buffer is laid out
as the engine ranks receive it instead: engine rank 0's slices of the bucket's HF tensors back to
back, then rank 1's, ... (:class:`RankSlices`); the same copy instructions write each piece into
every engine rank's slice it overlaps, so the transport sends each rank's segment as it is, with
no packing copy. A remote row piece that lands in one engine rank's row block, or a column shard
that is exactly one engine rank's column block, is received there directly; otherwise the whole
shard is received into a temporary and copied.

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


SEGMENT_ALIGN = 64
"""Bytes each engine rank's segment of a sliced bucket starts on (every dtype view stays aligned)."""


@dataclass
class RankSlices:
    """A bucket laid out per engine rank (``StageGatherer(sliced=True)``).

    ``parts[r]``: engine rank ``r``'s ``[(hf_name, view)]`` in wire order (views of its slices);
    ``segments[r]``: ``[nbytes_r]`` uint8, those slices back to back (what rank ``r`` receives).
    """

    parts: list
    segments: list


def sliced_layout(plan: WeightSyncPlan, bucket: Bucket) -> tuple[list[tuple[int, int]], list[list[tuple]]]:
    """Engine-rank segments of a sliced bucket: ``([(start, nbytes)] per rank, regions)`` with
    ``regions[j]`` = ``[(rank, TensorSlice, byte offset in the flat buffer)]`` for HF tensor ``j``."""
    tp = plan.engine_layout.tp_size
    regions: list[list[tuple]] = [[] for _ in bucket.hf_tensors]
    per_rank: list[list[tuple]] = [[] for _ in range(tp)]  # (j, slice, nbytes)
    for j, spec in enumerate(bucket.hf_tensors):
        for rank, sl in plan.engine_slices_of(spec).items():
            n = torch.Size(sl.shape(spec.shape)).numel() * torch_dtype(spec.dtype).itemsize
            per_rank[rank].append((j, sl, n))
    segments, offset = [], 0
    for rank, entries in enumerate(per_rank):
        offset = -(-offset // SEGMENT_ALIGN) * SEGMENT_ALIGN
        start = offset
        for j, sl, n in entries:
            regions[j].append((rank, sl, offset))
            offset += n
        segments.append((start, offset - start))
    return segments, regions


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
        sliced: lay each bucket out per engine rank (:class:`RankSlices`, see module docstring);
            every rank of the stage must pass the same value (it decides which messages travel).
    """

    def __init__(self, plan: WeightSyncPlan, rank: int, local: Mapping[str, torch.Tensor], placement: Placement,
                 *, max_in_flight: int = 2, group: Optional[dist.ProcessGroup] = None,
                 ring: Optional[list[Optional[torch.Tensor]]] = None, sliced: bool = False) -> None:
        self.plan, self.rank, self.local, self.placement = plan, rank, local, placement
        self.max_in_flight, self.group, self.sliced = max_in_flight, group, sliced
        self.timings = GatherTimings()
        if ring is not None and len(ring) != RING_SLOTS:
            raise ValueError(f"ring must hold {RING_SLOTS} slots, got {len(ring)}")
        self._ring: list[Optional[torch.Tensor]] = ring if ring is not None else [None] * RING_SLOTS
        self._layouts: dict[int, tuple] = {}  # bucket index -> sliced_layout
        self._positions: dict[int, dict[str, list[int]]] = {}  # bucket index -> _where

    def _where(self, bucket: Bucket) -> dict[str, list[int]]:
        """Megatron name -> the position in ``bucket.hf_tensors`` (wire order) of each of its HF
        tensors. Not params order plus an offset: the wire order puts larger elements first (a
        bf16 model's fp32 router bias moves ahead), so positions come from the HF names (cached)."""
        if bucket.index not in self._positions:
            at = {t.name: j for j, t in enumerate(bucket.hf_tensors)}
            self._positions[bucket.index] = {t.param.name: [at[h.name] for h in t.param.hf] for t in bucket.params}
        return self._positions[bucket.index]

    def _layout(self, bucket: Bucket) -> tuple:
        """:func:`sliced_layout` of ``bucket`` (cached)."""
        if bucket.index not in self._layouts:
            self._layouts[bucket.index] = sliced_layout(self.plan, bucket)
        return self._layouts[bucket.index]

    def _direct(self, bucket: Bucket, hf_positions: list[int], piece) -> bool:
        """``piece`` can be received straight into its place (one contiguous destination): rows
        into an HF tensor or into one engine rank's row block or whole tensor; with ``sliced``
        also columns into the one engine rank's column block that they are exactly."""
        if not self.sliced:
            return piece.axis == 0
        regions = self._layout(bucket)[1][hf_positions[piece.hf_index]]
        if len(regions) != 1:
            return False
        _, sl, _ = regions[0]
        if piece.axis == 0:
            return sl.axis is None or (sl.axis == 0 and sl.start <= piece.dst[0] and piece.dst[1] <= sl.stop)
        return sl.axis == piece.axis and (sl.start, sl.stop) == tuple(piece.dst)

    def _messages(self, bucket: Bucket):
        """Every point-to-point message of a bucket, in the order both sides use:
        ``(source_rank, transfer, source, piece or None)``; None = the whole shard (to a temporary)."""
        where = self._where(bucket)
        for transfer in bucket.params:
            pieces = self.placement.pieces(transfer)
            for source in transfer.sources:
                if source.trainer_rank == bucket.sender_rank:
                    continue
                mine = [p for p in pieces if p.shard == source.shard_index]
                if not all(self._direct(bucket, where[transfer.param.name], p) for p in mine):
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
                data = shard if piece is None else shard.narrow(piece.axis, piece.src[0], piece.src[1] - piece.src[0])
                works.append(isend(data.contiguous(), bucket.sender_rank, group=self.group, tag=bucket.index))
                sent += data.numel() * data.element_size()
            in_flight.append(works)
        for works in in_flight:
            for work in works:
                work.wait()
        return sent

    # ------------------------------------------------------------------ sender
    def _slot(self, bucket: Bucket, nbytes: int, device: torch.device) -> torch.Tensor:
        i = bucket.index % RING_SLOTS
        slot = self._ring[i]
        if slot is None or slot.numel() < nbytes or slot.device != device:
            slot = torch.empty(max(nbytes, self.plan.bucket_size_bytes), dtype=torch.uint8, device=device)
            self._ring[i] = slot
        return slot[:nbytes]

    def _targets(self, bucket: Bucket, device: torch.device):
        """``(flat, handed, targets)``: the bucket's buffer, what the transport gets for its tensors
        (HF views, or :class:`RankSlices`), and per HF tensor ``[(TensorSlice or None, view)]``: where
        its rows / columns go (None: the whole tensor)."""
        if not self.sliced:
            flat = self._slot(bucket, bucket.nbytes, device)
            views = _views(bucket, flat)
            return flat, views, [[(None, v)] for _, v in views]
        segments, regions = self._layout(bucket)
        start, size = segments[-1]
        flat = self._slot(bucket, start + size, device)
        targets, parts = [], [[] for _ in segments]
        for spec, places in zip(bucket.hf_tensors, regions):
            mine = []
            for rank, sl, offset in places:
                shape = sl.shape(spec.shape)
                n = torch.Size(shape).numel() * torch_dtype(spec.dtype).itemsize
                view = flat[offset:offset + n].view(torch_dtype(spec.dtype)).view(shape)
                mine.append((sl if sl.axis is not None else None, view))
                parts[rank].append((spec.name, view))
            targets.append(mine)
        handed = RankSlices(parts, [flat[a:a + n] for a, n in segments])
        return flat, handed, targets

    def _post(self, bucket: Bucket, device: torch.device):
        flat, handed, targets = self._targets(bucket, device)
        where = self._where(bucket)
        works, temps = [], []
        for source_rank, transfer, source, piece in self._messages(bucket):
            dtype = torch_dtype(transfer.param.dtype)
            if piece is None:
                buffer = torch.empty(source.shape, dtype=dtype, device=device)
                temps.append((transfer, source, buffer))
            else:
                (sl, view), = targets[where[transfer.param.name][piece.hf_index]]
                at = piece.dst[0] - (sl.start if sl is not None else 0)
                buffer = view.narrow(piece.axis, at, piece.dst[1] - piece.dst[0])
            works.append(irecv(buffer, source_rank, group=self.group, tag=bucket.index))
            self.timings.bytes_received += buffer.numel() * buffer.element_size()
        return flat, handed, targets, works, temps

    def _place_local(self, bucket: Bucket, targets, temps) -> None:
        where = self._where(bucket)
        for transfer, source, buffer in temps:
            for piece in self.placement.pieces(transfer):
                if piece.shard == source.shard_index:
                    self._copy(targets[where[transfer.param.name][piece.hf_index]], buffer, piece)
        for transfer in bucket.params:
            for source in transfer.sources:
                if source.trainer_rank != self.rank:
                    continue
                shard = self.local[transfer.param.name].detach()
                for piece in self.placement.pieces(transfer):
                    if piece.shard == source.shard_index:
                        self._copy(targets[where[transfer.param.name][piece.hf_index]], shard, piece)

    @staticmethod
    def _copy(places, shard: torch.Tensor, piece) -> None:
        """Copy ``piece`` of ``shard`` into every place of its HF tensor it overlaps.

        ``places``: ``[(slice or None, view)]``; a view holds the HF tensor's ``[start, stop)`` along
        ``slice.axis`` (all of it for None). The piece covers ``piece.dst`` along ``piece.axis``.
        """
        a, (d0, d1) = piece.axis, piece.dst
        src = shard.narrow(a, piece.src[0], d1 - d0)
        for sl, view in places:
            if sl is None:
                view.narrow(a, d0, d1 - d0).copy_(src)
            elif sl.axis == a:
                lo, hi = max(d0, sl.start), min(d1, sl.stop)
                if lo < hi:
                    view.narrow(a, lo - sl.start, hi - lo).copy_(src.narrow(a, lo - d0, hi - lo))
            else:
                view.narrow(a, d0, d1 - d0).copy_(src.narrow(sl.axis, sl.start, sl.stop - sl.start))

    def iter_hf_buckets(self) -> Iterator[tuple[Bucket, object, torch.Tensor]]:
        """Yield ``(bucket, tensors, flat)`` for each bucket this rank sends.

        ``tensors``: ``[(hf_name, view)]`` (wire order; views of ``flat``, which holds the bucket's
        HF tensors back to back), or with ``sliced`` a :class:`RankSlices` (views and segments of
        ``flat``). ``flat`` stays untouched until bucket ``index + RING_SLOTS`` is gathered.
        """
        mine = [b for b in self.plan.buckets if b.sender_rank == self.rank]
        device = next(iter(self.local.values())).device if self.local else torch.device("cpu")
        pending = self._post(mine[0], device) if mine else None
        for i, bucket in enumerate(mine):
            flat, handed, targets, works, temps = pending
            start = time.perf_counter()
            for work in works:
                work.wait()
            gathered = time.perf_counter()
            pending = self._post(mine[i + 1], device) if i + 1 < len(mine) else None
            self._place_local(bucket, targets, temps)
            done = time.perf_counter()
            self.timings.gather_s += gathered - start
            self.timings.convert_s += done - gathered
            self.timings.per_bucket.append({"bucket": bucket.index, "gather_s": gathered - start,
                                            "convert_s": done - gathered, "bytes": bucket.nbytes})
            yield bucket, handed, flat
