"""The two checked transports (:mod:`megarl.weight_sync.checked`): ``p2p``, each engine rank
receives exactly its own slices point to point, and ``distributed`` through megarl's receiver,
every engine rank receives every tensor whole by one broadcast per bucket."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from megarl.training.collectives import broadcast
from megarl.weight_sync.checked import CheckedTransport
from megarl.weight_sync.plan import Bucket


class P2PTransport(CheckedTransport):
    """Shard-to-shard over a process group with every engine rank, any host (see
    :mod:`megarl.weight_sync.checked`).

    Per sync: one ticket per engine rank (``/update_weights_from_tensor`` with ``load_format`` =
    the receiver loader) announces every bucket of the stage (names, dtypes, shapes of that rank's
    slices, from the plan), before the first bucket is packed, so the engines' HTTP hop overlaps
    the packing and no other request follows until the stage is done. Per bucket: each engine
    rank's slices (a :class:`~megarl.weight_sync.segments.RankSlices` bucket, laid out per engine
    rank by the gatherer: each rank's segment as it is; an HF-layout bucket: packed, with no copy
    when a rank holds every tensor whole), checksummed per tensor and sent point to point, the checksums right after the
    bytes; then every group rank joins a
    vote (one all-reduce) and the engines load only if every rank received intact, expected
    tensors (:mod:`megarl.weight_sync.receiver`). Bucket ``b + 1``'s bytes leave right after
    ``b``'s vote; packing ``b + 1`` and gathering ``b + 2`` overlap the transfer of ``b``, and the
    engines load ``b`` while ``b + 1``'s bytes arrive. After the last bucket the receivers load it
    and join the finish vote (loading errors) within the same call.

    With segment senders (:meth:`set_senders`), engine rank ``r``'s segment of a bucket comes from
    the trainer rank :class:`~megarl.weight_sync.segments.SegmentOwners` names (its slices that are
    contiguous parts of that rank's own shards straight from the parameters, in the messages the
    ticket lists); every sender joins every vote and sees the same outcome; only the stage sender
    talks to the engines over HTTP.

    A refused bucket ends the stage on both sides (the receivers return, the sender sends no
    more). When the sender itself fails mid-stage (a gather or conversion error), :meth:`abort`
    releases the receivers waiting for the next bucket: a bucket of zeros of the announced size,
    voted down by the sender (for the ranks it sends to; the others' senders send theirs), so that
    no engine loads it and the group stays usable. A segment sender other than the stage sender
    waits for the group's collectives without the engines' HTTP answers to watch: an engine that
    fails makes it wait up to ``timeout_s``.

    ``tamper``: for fault-injection tests only: ``tamper(bucket_index, engine_tp_rank, buffer)``
    is called after the checksums and may return a replacement buffer to send to that rank.
    """

    name = "p2p"
    sliced_buckets = True
    mode = "p2p"
    """The tickets' ``mode``: each engine rank receives its own slices point to point."""

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self._pool: dict[tuple[int, int], torch.Tensor] = {}  # (slot, engine rank) -> packing buffer, kept across syncs

    def _slices(self, bucket: Bucket, tensors) -> list[list[tuple[str, torch.Tensor]]]:
        """Each engine rank's ``[(name, view)]`` of the bucket (wire order), views of ``tensors``."""
        parts: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(self.plan.engine_layout.tp_size)]
        for (name, tensor), spec in zip(tensors, bucket.hf_tensors):
            for rank, sl in self.plan.engine_slices_of(spec).items():
                parts[rank].append((name, sl.take(tensor)))
        return parts

    def _listings(self, bucket: Bucket) -> list[list]:
        """Each engine rank's ticket listing ``[[name, dtype, shape]]`` of ``bucket`` (wire order),
        from the plan alone (the tensors' metadata)."""
        parts: list[list] = [[] for _ in range(self.plan.engine_layout.tp_size)]
        for spec in bucket.wire:
            for rank, sl in self.plan.engine_slices_of(spec).items():
                parts[rank].append([spec.name, spec.dtype, list(sl.shape(spec.shape))])
        return parts

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, list, list]]:
        """``(rank, messages [[nbytes] uint8, ...], listing [[name, dtype, shape, checksum]])`` for
        each engine rank this sender sends, in order, packed lazily (a rank's bytes may leave while
        the next rank's are packed)."""
        from megarl.weight_sync.segments import RankSlices
        from megarl.weight_sync.wire import checksum, checksum_algo

        algo = self._algo or checksum_algo(flat.device)
        if isinstance(tensors, RankSlices):  # laid out per engine rank already: each segment as it is
            for rank, (mine, segment) in enumerate(zip(tensors.parts, tensors.segments)):
                if segment is None:  # another sender's (several senders per stage)
                    continue
                listing = [[name, str(v.dtype).removeprefix("torch."), list(v.shape),
                            checksum(v.reshape(-1).view(torch.uint8), algo)] for name, v in mine]
                yield rank, tensors.messages[rank] if tensors.messages is not None else [segment], listing
            return
        flat_device = flat.device
        parts = self._slices(bucket, tensors)
        sums: dict[tuple, str] = {}
        whole = [t for _, t in tensors]
        for rank, mine in enumerate(parts):
            if len(mine) == len(whole) and all(v is w for (_, v), w in zip(mine, whole)):
                buffer = flat  # every tensor whole: the bucket itself, no copy
            else:
                size = sum(v.numel() * v.element_size() for _, v in mine)
                key = (bucket.index % 2, rank)
                pooled = self._pool.get(key)
                if pooled is None or pooled.numel() < size or pooled.device != flat_device:
                    pooled = torch.empty(max(size, 1), dtype=torch.uint8, device=flat_device)
                    self._pool[key] = pooled
                buffer, offset = pooled[:size], 0
                for _, v in mine:
                    n = v.numel() * v.element_size()
                    buffer[offset:offset + n].view(v.dtype).view(v.shape).copy_(v)
                    offset += n
            listing, offset = [], 0
            for name, v in mine:
                n = v.numel() * v.element_size()
                sum_key = (name, v.storage_offset(), tuple(v.shape))
                if sum_key not in sums:
                    sums[sum_key] = checksum(buffer[offset:offset + n], algo)
                listing.append([name, str(v.dtype).removeprefix("torch."), list(v.shape), sums[sum_key]])
                offset += n
            yield rank, [buffer], listing


class CheckedDistributedTransport(CheckedTransport):
    """``distributed`` through the receiver: one broadcast of the whole bucket per bucket, checked.

    The same bytes as SGLang's ``/update_weights_from_distributed`` (every engine rank receives
    every tensor whole, by one broadcast of the flat bucket over the group), but announced by a
    ticket carrying each tensor's checksum, checked by every engine rank against the checksum and
    the served checkpoint (name known, dtype and shape equal to the checkpoint's) and voted on
    before any engine loads (:class:`P2PTransport`'s ordering and failure reports). ``tamper``
    sees engine rank 0's buffer only: the one broadcast carries it to every rank.
    """

    name = "distributed"
    sliced_buckets = False
    mode = "broadcast"
    """The tickets' ``mode``: every engine rank joins one broadcast of the whole bucket."""

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, list, list]]:
        """The flat bucket for every engine rank, and the listing ``[[name, dtype, shape, checksum]]``."""
        from megarl.weight_sync.wire import checksum, checksum_algo

        algo = self._algo or checksum_algo(flat.device)  # the ticket's (the group's device)
        listing = [[name, str(t.dtype).removeprefix("torch."), list(t.shape), checksum(t, algo)] for name, t in tensors]
        for rank in range(self.plan.engine_layout.tp_size):
            yield rank, [flat], listing

    def _listings(self, bucket: Bucket) -> list[list]:
        """Every engine rank's listing: every tensor whole ``[[name, dtype, shape]]`` (from the plan)."""
        listing = [[spec.name, spec.dtype, list(spec.shape)] for spec in bucket.wire]
        return [listing] * self.plan.engine_layout.tp_size

    def _transfer(self, rank: int, messages: list, sums: torch.Tensor) -> list:
        """Engine rank 0's buffer (the whole bucket, one message) goes to every engine rank in one
        broadcast, then its checksums in another; the other ranks' (the same) send nothing."""
        if rank != 0:
            return []
        return [broadcast(message, 0, group=self.group, async_op=True) for message in (*messages, sums)
                if message.numel()]

