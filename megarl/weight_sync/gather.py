"""Trainer side of a weight sync: each stage sender assembles its buckets' HF tensors in place.

For every bucket, the sender owns one flat byte buffer laid out exactly as the engines expect it
(the bucket's HF tensors back to back, wire order). Following the copy instructions of
:mod:`megarl.weight_sync.copy_instructions` (the family mapping, traced), it

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
memory), so no buffer is reused while the engines may still read it. A source rank has at most ``max_in_flight`` buckets
of sends open.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.training.collectives import irecv, isend
from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.manifest_checks import required
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.segments import RankSlices, SegmentOwners, overlaps, sliced_layout
from megarl.weight_sync.specs import torch_dtype

RING_SLOTS = 3


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
        placement: copy instructions (:class:`~megarl.weight_sync.copy_instructions.Placement`).
        max_in_flight: buckets a source rank may have open sends for.
        group: process group containing the trainer ranks (default: the default group).
        ring: the sender's ``RING_SLOTS`` bucket buffers, to reuse across syncs (filled in place);
            None: fresh buffers. On CPU a fresh bucket-sized buffer is fresh memory from the OS
            and every page of it faults on first touch; CUDA's caching allocator reuses freed
            blocks by itself.
        sliced: lay each bucket out per engine rank (:class:`RankSlices`, see module docstring);
            every rank of the stage must pass the same value (it decides which messages travel).
        owners: with ``sliced``: each engine rank's segment is assembled by the trainer rank
            :class:`SegmentOwners` names (several senders per stage); None: all by the stage
            sender. Every rank of the stage must pass the same.
        cache: a dict kept across syncs of the same plan (message lists, positions, layouts:
            metadata only); None: this gatherer's own.
    """

    def __init__(self, plan: WeightSyncPlan, rank: int, local: Mapping[str, torch.Tensor], placement: Placement,
                 *, max_in_flight: int = 2, group: dist.ProcessGroup | None = None,
                 ring: list[torch.Tensor | None] | None = None, sliced: bool = False,
                 owners: SegmentOwners | None = None, cache: dict | None = None) -> None:
        if owners is not None and not sliced:
            raise ValueError("segment owners need sliced buckets")
        self.plan, self.rank, self.local, self.placement = plan, rank, local, placement
        self.max_in_flight, self.group, self.sliced, self.owners = max_in_flight, group, sliced, owners
        self.timings = GatherTimings()
        if ring is not None and len(ring) != RING_SLOTS:
            raise ValueError(f"ring must hold {RING_SLOTS} slots, got {len(ring)}")
        self._ring: list[torch.Tensor | None] = ring if ring is not None else [None] * RING_SLOTS
        cache = cache if cache is not None else {}
        mode = (sliced, owners.several if owners is not None else None)  # the messages depend on it
        self._layouts: dict[int, tuple] = cache.setdefault(("layouts", mode), {})  # bucket index -> sliced_layout
        self._positions: dict[int, dict[str, list[int]]] = cache.setdefault(("positions", mode), {})  # -> _where
        self._message_lists: dict[int, list] = cache.setdefault(("messages", mode), {})  # bucket index -> _messages
        self._flat_shards: dict[str, torch.Tensor] = {}  # this sync's shards as bytes (sent without a copy)
        self._sends: deque = deque()  # this assembler's open sends to other assemblers, per bucket

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
        if self.owners is not None:
            return self.owners.layout(bucket)
        if bucket.index not in self._layouts:
            self._layouts[bucket.index] = sliced_layout(self.plan, bucket)
        return self._layouts[bucket.index]

    def assemblers(self, bucket: Bucket) -> list[int]:
        """The trainer rank assembling each engine rank's segment ``[engine tp]`` (the stage sender
        for every segment unless ``owners``; an HF-layout bucket has one "segment")."""
        if self.owners is not None:
            return self.owners.owners(bucket)
        return [bucket.sender_rank] * (self.plan.engine_layout.tp_size if self.sliced else 1)

    def _direct(self, bucket: Bucket, hf_positions: list[int], piece, dest: int) -> int | None:
        """Where ``piece`` can be received by ``dest`` straight into its place: the index of the one
        target (in :meth:`_targets`' list for its HF tensor) that holds all of it contiguously,
        or None.

        Rows go into an HF tensor, or (``sliced``) into the engine rank's row block or whole tensor
        holding them, when no other engine rank's slice assembled by ``dest`` needs any of them;
        columns (``sliced``) go into the one engine rank's column block that they are exactly.
        Anything else is received whole into a temporary and copied."""
        if not self.sliced:
            return 0 if piece.axis == 0 else None
        regions = self._layout(bucket)[1][hf_positions[piece.hf_index]]
        owners = self.assemblers(bucket)
        d0, d1 = piece.dst
        overlapping = [k for k, (rank, sl, _) in enumerate(regions) if owners[rank] == dest and overlaps(sl, piece)]
        if len(overlapping) != 1:
            return None
        k = overlapping[0]
        sl = regions[k][1]
        if piece.axis == 0:
            met = sl.meet(d0, d1) if sl.axis == 0 else None
            fits = sl.axis is None or (met is not None and met[:2] == (d0, d1))
        else:
            fits = sl.axis == 1 and (sl.start, sl.stop) == (d0, d1)
        return k if fits else None

    def _destinations(self, bucket: Bucket, hf_positions: list[int], pieces) -> list[int]:
        """The assemblers needing any of ``pieces`` (ascending)."""
        if self.owners is None:
            return [bucket.sender_rank]
        layout, owners = self._layout(bucket)[1], self.assemblers(bucket)
        dests: set[int] = set()
        for piece in pieces:
            dests.update(owners[rank] for rank, sl, _ in layout[hf_positions[piece.hf_index]] if overlaps(sl, piece))
        return sorted(dests)

    def _messages(self, bucket: Bucket) -> list:
        """Every point-to-point message of a bucket, in the order both sides use: ``(source_rank,
        dest_rank, transfer, source, piece or None)``; None = the whole shard (to a temporary). Cached."""
        if bucket.index not in self._message_lists:
            self._message_lists[bucket.index] = list(self._make_messages(bucket))
        return self._message_lists[bucket.index]

    def _make_messages(self, bucket: Bucket):
        where = self._where(bucket)
        for transfer in bucket.params:
            pieces = self.placement.pieces(transfer)
            hf_positions = where[transfer.param.name]
            for source in transfer.sources:
                mine = [p for p in pieces if p.shard == source.shard_index]
                for dest in self._destinations(bucket, hf_positions, mine):
                    if dest == source.trainer_rank:
                        continue
                    if any(self._direct(bucket, hf_positions, p, dest) is None for p in mine):
                        yield source.trainer_rank, dest, transfer, source, None
                    else:
                        for piece in mine:
                            yield source.trainer_rank, dest, transfer, source, piece

    def _isend_mine(self, bucket: Bucket) -> tuple[list, int]:
        """Start sending this rank's shards of ``bucket`` to the ranks assembling them: ``(works, bytes)``
        (views of the live parameters where contiguous; the works keep the tensors alive)."""
        works, sent = [], 0
        for source_rank, dest, transfer, _, piece in self._messages(bucket):
            if source_rank != self.rank:
                continue
            shard = self.local[transfer.param.name].detach()
            data = shard if piece is None else shard.narrow(piece.axis, piece.src[0], piece.src[1] - piece.src[0])
            works.append(isend(data.contiguous(), dest, group=self.group, tag=bucket.index))
            sent += data.numel() * data.element_size()
        return works, sent

    # ------------------------------------------------------------------ source ranks
    def send_contributions(self) -> int:
        """Send this rank's shards of every bucket it assembles nothing of. Returns bytes sent."""
        in_flight: deque = deque()
        sent = 0
        for bucket in self.plan.buckets:
            if self.rank in self.assemblers(bucket) or not bucket.contributions(self.rank):
                continue
            while len(in_flight) >= self.max_in_flight:
                for work in in_flight.popleft():
                    work.wait()
            works, n = self._isend_mine(bucket)
            sent += n
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
        (HF views, or :class:`RankSlices`), and per HF tensor ``[(TensorSlice or None, view or
        None)]``, one per region of :func:`sliced_layout`: where its rows / columns go (slice None:
        the whole tensor; view None: a segment another rank assembles). With ``owners`` the buffer
        spans only this rank's segments (None when it assembles none of the bucket)."""
        if not self.sliced:
            flat = self._slot(bucket, bucket.nbytes, device)
            views = _views(bucket, flat)
            return flat, views, [[(None, v)] for _, v in views]
        segments, regions = self._layout(bucket)
        owners = self.assemblers(bucket)
        ours = [r for r in range(len(segments)) if owners[r] == self.rank]
        if not ours:
            return None, RankSlices([None] * len(segments), [None] * len(segments), [None] * len(segments)), [
                [(sl if sl.axis is not None else None, None) for _, sl, _ in places] for places in regions]
        runs, local = self.owners.runs(bucket) if self.owners is not None else (None, {})
        base = segments[ours[0]][0]
        end = max(a + n for a, n in (segments[r] for r in ours))
        flat = self._slot(bucket, end - base, device)
        targets = []
        parts: list = [[] if r in ours else None for r in range(len(segments))]
        for j, (spec, places) in enumerate(zip(bucket.hf_tensors, regions)):
            mine = []
            for rank, sl, offset in places:
                view = None
                if owners[rank] == self.rank:
                    shape = sl.shape(spec.shape)
                    n = torch.Size(shape).numel() * torch_dtype(spec.dtype).itemsize
                    src = local.get((j, rank))
                    if src is not None:  # sent from the parameter itself: nothing to write here
                        parts[rank].append((spec.name, self._shard_bytes(src[0])[src[1]:src[1] + n]
                                            .view(torch_dtype(spec.dtype)).view(shape)))
                    else:
                        view = flat[offset - base:offset - base + n].view(torch_dtype(spec.dtype)).view(shape)
                        parts[rank].append((spec.name, view))
                mine.append((sl if sl.axis is not None else None, view))
            targets.append(mine)
        messages: list[list | None] = [None] * len(segments)
        for r in ours:
            if runs is None:
                a, n = segments[r]
                messages[r] = [flat[a - base:a - base + n]]
            else:
                messages[r] = [flat[o - base:o - base + n] if src is None
                               else self._shard_bytes(src[0])[src[1]:src[1] + n] for o, n, src in runs[r]]
        handed = RankSlices(parts, [flat[a - base:a - base + n] if r in ours else None
                                    for r, (a, n) in enumerate(segments)], messages)
        return flat, handed, targets

    def _shard_bytes(self, name: str) -> torch.Tensor:
        """This rank's shard of parameter ``name`` as flat bytes (its own memory when contiguous)."""
        if name not in self._flat_shards:
            shard = self.local[name].detach()
            self._flat_shards[name] = shard.contiguous().reshape(-1).view(torch.uint8)
        return self._flat_shards[name]

    def _post(self, bucket: Bucket, device: torch.device):
        flat, handed, targets = self._targets(bucket, device)
        where = self._where(bucket)
        works, temps = [], []
        for source_rank, dest, transfer, source, piece in self._messages(bucket):
            if dest != self.rank:
                continue
            dtype = torch_dtype(transfer.param.dtype)
            if piece is None:
                buffer = torch.empty(source.shape, dtype=dtype, device=device)
                temps.append((transfer, source, buffer))
            else:
                hf_positions = where[transfer.param.name]
                sl, view = targets[hf_positions[piece.hf_index]][self._direct(bucket, hf_positions, piece, dest)]
                at = piece.dst[0] if sl is None else required(sl.meet(*piece.dst), "the piece's block")[2]
                buffer = view.narrow(piece.axis, at, piece.dst[1] - piece.dst[0])
            works.append(irecv(buffer, source_rank, group=self.group, tag=bucket.index))
            self.timings.bytes_received += buffer.numel() * buffer.element_size()
        if self.owners is not None:  # this assembler's shards that other assemblers need
            sends, _ = self._isend_mine(bucket)
            self._sends.append(sends)
        return flat, handed, targets, works, temps

    def _place_local(self, bucket: Bucket, targets, temps) -> None:
        if all(view is None for places in targets for _, view in places):  # assembles none of it
            return
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

        ``places``: ``[(slice or None, view or None)]``; a view holds the HF tensor's ``[start,
        stop)`` along ``slice.axis`` (all of it for None); a None view is skipped (another rank's).
        The piece covers ``piece.dst`` along ``piece.axis``.
        """
        a, (d0, d1) = piece.axis, piece.dst
        src = shard.narrow(a, piece.src[0], d1 - d0)
        for sl, view in places:
            if view is None:
                continue
            if sl is None:
                view.narrow(a, d0, d1 - d0).copy_(src)
            elif sl.axis == a:
                met = sl.meet(d0, d1)
                if met is not None:
                    lo, hi, at = met
                    view.narrow(a, at, hi - lo).copy_(src.narrow(a, lo - d0, hi - lo))
            else:
                view.narrow(a, d0, d1 - d0).copy_(sl.take(src))

    def sends_buckets(self) -> list[Bucket]:
        """The buckets :meth:`iter_hf_buckets` yields on this rank: those it sends (the stage
        sender's; with ``owners``, every bucket of a stage this rank assembles any segment of)."""
        if self.owners is None:
            return [b for b in self.plan.buckets if b.sender_rank == self.rank]
        stages = {pp for pp in {b.pp_rank for b in self.plan.buckets} if self.rank in self.owners.senders(pp)}
        return [b for b in self.plan.buckets if b.pp_rank in stages]

    def iter_hf_buckets(self) -> Iterator[tuple[Bucket, object, torch.Tensor | None]]:
        """Yield ``(bucket, tensors, flat)`` for each of :meth:`sends_buckets`.

        ``tensors``: ``[(hf_name, view)]`` (wire order; views of ``flat``, which holds the bucket's
        HF tensors back to back), or with ``sliced`` a :class:`RankSlices` (views and segments of
        ``flat``; with ``owners``, None for the segments other ranks assemble, and ``flat`` None
        when this rank assembles none). ``flat`` stays untouched until bucket ``index +
        RING_SLOTS`` is gathered. With ``owners`` this rank also sends its shards to the other
        assemblers, bucket by bucket.
        """
        mine = self.sends_buckets()
        device = next(iter(self.local.values())).device if self.local else torch.device("cpu")
        pending = self._post(mine[0], device) if mine else None
        for i, bucket in enumerate(mine):
            if pending is None:  # posted one bucket ahead (below)
                raise RuntimeError(f"weight sync gather: bucket {bucket.index} was not posted before its turn")
            flat, handed, targets, works, temps = pending
            start = time.perf_counter()
            for work in works:
                work.wait()
            gathered = time.perf_counter()
            while len(self._sends) > 1:  # bucket b's sends: matched by receives posted with b's
                for work in self._sends.popleft():
                    work.wait()
            pending = self._post(mine[i + 1], device) if i + 1 < len(mine) else None
            self._place_local(bucket, targets, temps)
            done = time.perf_counter()
            self.timings.gather_s += gathered - start
            self.timings.convert_s += done - gathered
            self.timings.per_bucket.append({"bucket": bucket.index, "gather_s": gathered - start,
                                            "convert_s": done - gathered, "bytes": bucket.nbytes})
            yield bucket, handed, flat
        while self._sends:
            for work in self._sends.popleft():
                work.wait()
