"""Buckets laid out per engine rank: which slices each engine rank receives, who sends them, and in
which messages (metadata only; :mod:`megarl.weight_sync.gather` fills them, the ``p2p`` transport
sends them and announces them in its stage ticket).

- :func:`sliced_layout`: where each engine rank's slices of a bucket's HF tensors sit in the
  bucket's buffer (one segment per engine rank, its slices back to back in wire order);
- :class:`SegmentOwners`: the trainer rank that assembles and sends each segment (segment
  senders), and the messages it travels in (:meth:`SegmentOwners.runs`: slices that are
  contiguous parts of the sender's own shard go from the parameter itself);
- :class:`RankSlices`: one bucket as the gatherer hands it to the transport.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.specs import torch_dtype

SEGMENT_ALIGN = 64
"""Bytes each engine rank's segment of a sliced bucket starts on (every dtype view stays aligned)."""


@dataclass
class RankSlices:
    """A bucket laid out per engine rank (``StageGatherer(sliced=True)``).

    ``parts[r]``: engine rank ``r``'s ``[(hf_name, view)]`` in wire order (views of its slices);
    ``segments[r]``: ``[nbytes_r]`` uint8, those slices back to back (what rank ``r`` receives);
    ``messages[r]``: the same bytes as the messages they travel in (:meth:`SegmentOwners.runs`:
    flat uint8 views of the segment, or of this rank's own parameters where a slice is a
    contiguous part of one: those slices' views in ``parts`` are of the parameter too, and their
    place in ``segments`` stays unwritten). None entries: segments another rank sends.
    """

    parts: list
    segments: list
    messages: list | None = None


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


def overlaps(sl, piece, name: str = "") -> bool:
    """Placement piece ``piece`` has elements inside engine slice ``sl`` of the same HF tensor ``name`` (a
    whole-tensor slice, or one split along the other axis, overlaps every piece).

    Raises:
        PlanError: the piece meets several of a sectioned slice's blocks (``TensorSlice.meet``).
    """
    return sl.axis != piece.axis or sl.meet(*piece.dst, name) is not None


def _overlap_bytes(spec, piece, sl) -> int:
    """Bytes of ``piece`` (of HF tensor ``spec``) inside the slice ``sl`` of that tensor."""
    shape = list(spec.shape)
    shape[piece.axis] = piece.dst[1] - piece.dst[0]
    if sl.axis is not None and sl.axis == piece.axis:
        met = sl.meet(*piece.dst, spec.name)
        shape[piece.axis] = 0 if met is None else met[1] - met[0]
    elif sl.axis is not None:
        shape[sl.axis] = sl.length
    return torch.Size(shape).numel() * torch_dtype(spec.dtype).itemsize


def _own_rows(spec, sl, pieces: list, owner: int) -> tuple[str, int] | None:
    """``(param name, byte offset in its shard)`` when engine slice ``sl`` of HF tensor ``spec`` is
    one contiguous part of ``owner``'s own shard (see :meth:`SegmentOwners.runs`), else None.
    ``pieces``: ``[(transfer, piece)]`` of that HF tensor."""
    over = [(t, p) for t, p in pieces if overlaps(sl, p, spec.name)]
    if len(over) != 1:
        return None
    transfer, piece = over[0]
    source = transfer.sources[piece.shard]
    if source.trainer_rank != owner or transfer.param.dtype != spec.dtype:
        return None
    if len(sl.spans()) > 1:  # a sectioned slice: several blocks, never one run of a shard's rows here
        return None
    if piece.axis == 0 and sl.axis in (None, 0):
        lo, hi = (0, spec.shape[0]) if sl.axis is None else (sl.start, sl.stop)
        if piece.dst[0] <= lo and hi <= piece.dst[1]:
            row = torch.Size(spec.shape[1:]).numel() * torch_dtype(spec.dtype).itemsize
            return transfer.param.name, (piece.src[0] + lo - piece.dst[0]) * row
        return None
    if piece.axis == 1 and sl.axis == 1 and tuple(piece.dst) == (sl.start, sl.stop) and \
            tuple(piece.src) == (0, source.shape[1]):
        return transfer.param.name, 0
    return None


class SegmentOwners:
    """Which trainer rank assembles and sends each engine rank's segment of each sliced bucket.

    Segment ``r`` of bucket ``b`` (engine rank ``r``'s slices, :func:`sliced_layout`) goes to the
    trainer rank holding most of its bytes (the plan's shard sources, located by the placement's
    pieces); a tie goes to the stage sender, then to the lower rank; an empty segment to the stage
    sender. That rank receives the rest of the segment from the ranks holding it (over the trainer
    group) and sends the segment to engine rank ``r``. Trainer TP2 -> engine TP2: trainer rank
    ``k`` assembles segment ``k`` of every bucket (all of it but the replicated norms and router,
    which come from the stage sender), so both halves leave their own rank instead of crossing the
    trainer group first.

    Args:
        plan: the (replica's) plan; placement: the conversion as copy instructions.
        several: False: the stage sender assembles every segment (one sender per stage; the
            messages of :meth:`runs` still send its own contiguous slices from the parameters).
    """

    def __init__(self, plan: WeightSyncPlan, placement: Placement, *, several: bool = True) -> None:
        self.plan, self.placement, self.several = plan, placement, several
        self._owners: dict[int, list[int]] = {}
        self._layouts: dict[int, tuple] = {}
        self._runs: dict[int, tuple] = {}
        self._senders: dict[int, list[int]] = {}

    def layout(self, bucket: Bucket) -> tuple:
        """:func:`sliced_layout` of ``bucket`` (cached)."""
        if bucket.index not in self._layouts:
            self._layouts[bucket.index] = sliced_layout(self.plan, bucket)
        return self._layouts[bucket.index]

    def owners(self, bucket: Bucket) -> list[int]:
        """The trainer rank assembling each engine rank's segment of ``bucket`` ``[engine tp]``."""
        if bucket.index not in self._owners and not self.several:
            self._owners[bucket.index] = [bucket.sender_rank] * self.plan.engine_layout.tp_size
        if bucket.index not in self._owners:
            lead = bucket.sender_rank
            self._owners[bucket.index] = [
                min(c, key=lambda t: (-c[t], t != lead, t)) if c else lead for c in self.holdings(bucket)]
        return self._owners[bucket.index]

    def holdings(self, bucket: Bucket) -> list[dict[int, int]]:
        """Per engine rank, the bytes of its segment of ``bucket`` each trainer rank holds
        ``[engine tp]{trainer rank: bytes}`` (from the plan's sources and the placement's pieces)."""
        credit: list[dict[int, int]] = [{} for _ in range(self.plan.engine_layout.tp_size)]
        regions = self.layout(bucket)[1]
        for j, pieces in enumerate(self._tensor_pieces(bucket)):
            for transfer, piece in pieces:
                holder = transfer.sources[piece.shard].trainer_rank
                for rank, sl, _ in regions[j]:
                    n = _overlap_bytes(bucket.hf_tensors[j], piece, sl)
                    if n:
                        credit[rank][holder] = credit[rank].get(holder, 0) + n
        return credit

    def _tensor_pieces(self, bucket: Bucket) -> list[list[tuple]]:
        """Per HF tensor of ``bucket`` (wire order), its placement pieces ``[(transfer, piece)]``."""
        at = {t.name: j for j, t in enumerate(bucket.hf_tensors)}
        pieces: list[list] = [[] for _ in bucket.hf_tensors]
        for transfer in bucket.params:
            for piece in self.placement.pieces(transfer):
                pieces[at[transfer.param.hf[piece.hf_index].name]].append((transfer, piece))
        return pieces

    def runs(self, bucket: Bucket) -> tuple[list[list[tuple]], dict]:
        """How each engine rank's segment travels: ``(messages, local)``.

        ``messages[r]``: ``[(offset, nbytes, source)]`` in segment order; ``source`` None: bytes
        of the bucket buffer at ``offset`` (assembled there); else ``(param name, byte offset)``:
        ``nbytes`` of the segment's owner's own shard of that parameter from that byte offset,
        sent from the parameter's memory without a copy. A slice goes that way when exactly one
        placement piece fills it, from the owner's shard, as contiguous rows (or as the whole shard
        of a column split), in the same dtype. Consecutive buffer slices, and slices consecutive in
        the same shard (a GLU shard's gate and up halves), travel as one message.
        ``local``: ``{(hf tensor index, engine rank): (param name, byte offset)}`` of those slices.
        Metadata only: the stage sender puts the message sizes in the stage ticket.
        """
        if bucket.index not in self._runs:
            segments, regions = self.layout(bucket)
            owners = self.owners(bucket)
            pieces = self._tensor_pieces(bucket)
            per_rank: list[list] = [[] for _ in segments]
            local = {}
            for j, places in enumerate(regions):
                spec = bucket.hf_tensors[j]
                for rank, sl, offset in places:
                    n = torch.Size(sl.shape(spec.shape)).numel() * torch_dtype(spec.dtype).itemsize
                    src = _own_rows(spec, sl, pieces[j], owners[rank])
                    if src is not None:
                        local[(j, rank)] = src
                    if n:
                        per_rank[rank].append((offset, n, src))
            messages = []
            for entries in per_rank:
                merged: list = []
                for offset, n, src in sorted(entries, key=lambda e: e[0]):
                    if merged:
                        o, m, last = merged[-1]
                        if (src is None and last is None and o + m == offset) or (
                                src is not None and last is not None and src[0] == last[0] and last[1] + m == src[1]):
                            merged[-1] = (o, m + n, last)
                            continue
                    merged.append((offset, n, src))
                messages.append(merged)
            self._runs[bucket.index] = (messages, local)
        return self._runs[bucket.index]

    def message_sizes(self, bucket: Bucket) -> list[list[int]]:
        """Bytes of each message of each engine rank's segment ``[engine tp][message]``."""
        return [[n for _, n, _ in msgs] for msgs in self.runs(bucket)[0]]

    def senders(self, pp_rank: int) -> list[int]:
        """The trainer ranks sending to the engines in stage ``pp_rank``: its stage sender first,
        then every other rank assembling a segment of any of its buckets (ascending; cached)."""
        if pp_rank not in self._senders:
            buckets = self.plan.stage_buckets(pp_rank)
            if not buckets:
                self._senders[pp_rank] = []
            else:
                lead = buckets[0].sender_rank
                self._senders[pp_rank] = [lead] + sorted({t for b in buckets for t in self.owners(b)} - {lead})
        return self._senders[pp_rank]
