"""The ``p2p`` transport with owner senders (``weight_sync.senders: owner``): every trainer rank of a
stage sends the parts of the engine ranks' slices that :class:`~megarl.weight_sync.owners.OwnerParts`
assigns it, cut from its own shards; nothing is gathered.

The protocol is :class:`~megarl.weight_sync.p2p.P2PTransport`'s (one group per stage, one stage
ticket per sync, per bucket the bytes then the checksums, then a vote of every group rank before
any engine loads, the finish vote with the load proof) with three differences: every rank of the
stage is a sender in the group (the stage sender, group rank 0, talks to the engines over HTTP);
each engine's ticket is its own (copies of a stage split the engines, so an engine rank's sources
depend on the engine) and lists the engine rank's parts with their source (:mod:`owners`); and each
sender sends one checksum per part it sent, after its parts, since no sender knows a whole slice.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from megarl.training.collectives import group_device, isend
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.owners import OwnerParts
from megarl.weight_sync.p2p import P2PTransport
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.wire import DIGEST_CHARS, checksum, checksum_algo, encode_sums


class OwnerTransport(P2PTransport):
    """``p2p`` from every trainer rank of a stage, each sending only what it holds (module docstring).

    Every rank of the stage calls :meth:`set_owner_senders` before the first sync and then
    :meth:`send` for every bucket of its stage with its own shards (``{global name: shard}``) in
    place of the converted tensors. ``stats.bytes_sent`` counts this rank's bytes (every engine).
    ``tamper(bucket_index, engine_tp_rank, buffer)``: fault injection, as ``P2PTransport``'s; the
    buffer is this sender's parts for that rank, back to back.
    """

    def set_owner_senders(self, senders: list[int], index: int, control, parts: OwnerParts,
                          buckets: list[Bucket]) -> None:
        """Every rank of the stage (``senders``: :meth:`OwnerParts.senders`; ``index``: this rank's
        position, 0 = the stage sender, which creates the group and announces the stage)."""
        self.set_senders(senders, index, control, parts, buckets)
        self.parts = parts

    @property
    def me(self) -> int:
        """This trainer rank's global rank (the sender of the parts it was assigned)."""
        return self.senders[self.sender_index]

    def _listings(self, bucket: Bucket) -> list[list]:
        return self.parts.listings(bucket)

    def _is_mine(self, bucket: Bucket, rank: int) -> bool:
        return any(self.parts.mine(bucket, i, rank, self.me) for i in range(len(self.engines)))

    def _released(self, bucket, engine: int, rank: int, stopped: set) -> bool:
        return bucket is not None and any(self.senders.index(p.sender) in stopped
                                          for p in self.parts.parts(bucket, engine, rank))

    def _announce(self, bucket: Bucket) -> None:
        """Every bucket of the stage from ``bucket`` on; the stage sender submits each engine's
        tickets (each engine rank's slices and parts), the others only take note."""
        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.wire import payload

        self._algo = checksum_algo(group_device(self.group))
        stage = [b for b in self.plan.buckets if b.pp_rank == bucket.pp_rank and b.index >= bucket.index]
        self._stage = [(b, self._listings(b), None) for b in stage]
        self._next, self._finish_announced = 0, True
        if self.sender_index:
            return
        for i in range(len(self.engines)):
            tickets = [{"op": "stage", "mode": self.mode, "group": self.group_name, "algo": self._algo,
                        "proof": self.load_proof,
                        "buckets": [self.parts.ticket_entry(b, i, rank, self.senders) for b, _, _ in self._stage]}
                       for rank in range(self.plan.engine_layout.tp_size)]
            self._requests.append(self.engines.submit(i, "update_weights_from_tensor", [payload(t) for t in tickets],
                                                      load_format=RECEIVER, flush_cache=False))

    def _pack(self, bucket: Bucket, local: Mapping[str, torch.Tensor]) -> list[tuple[int, int, list, list]]:
        """``[(engine, rank, [part bytes], [part checksums])]`` this rank sends of ``bucket`` (a part
        several engines get is cut and checksummed once)."""
        done: dict = {}
        out = []
        for i in range(len(self.engines)):
            for rank in range(self.plan.engine_layout.tp_size):
                mine = self.parts.mine(bucket, i, rank, self.me)
                if not mine:
                    continue
                for p in mine:
                    key = (p.name, p.shard, p.piece, p.slice, p.kind)
                    if key not in done:
                        data = self.parts.part_bytes(bucket, p, local)
                        done[key] = (data, checksum(data, self._algo or checksum_algo(data.device)))
                out.append((i, rank, [done[(p.name, p.shard, p.piece, p.slice, p.kind)][0] for p in mine],
                            [done[(p.name, p.shard, p.piece, p.slice, p.kind)][1] for p in mine]))
        return out

    def send(self, bucket, tensors, flat=None) -> None:
        """Send this rank's parts of ``bucket`` to every engine rank that gets any, then open the
        vote. ``tensors``: this rank's shards ``{global name: shard}``; ``flat`` unused.

        Raises:
            WeightSyncError: ``bucket`` is not the next announced one, or a shard this rank is
                assigned is missing or misshapen (the receivers were released first).
        """
        if self._pp_rank is None:
            raise WeightSyncError("p2p transport used before connect()")
        if self.group is None:
            self._join()
        if self._failure is not None:
            return
        started = time.perf_counter()
        first = self._stage is None
        if first:
            self._announce(bucket)
        try:
            packed = self._pack(bucket, tensors)
        except WeightSyncError:
            self.abort()
            raise
        if not first:
            self._wait_vote()
            if self._failure is not None:
                return
        stage = self._stage or []
        expected, listings, _ = stage[self._next] if self._next < len(stage) else (None, None, None)
        if expected is not bucket:
            self.abort()
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} is not the next announced one "
                                  f"({expected.index if expected is not None else 'none left'})")
        works: list = []
        refs: list = []
        device = group_device(self.group)
        self._partial = {"bucket": bucket, "works": works, "done": set()}
        for i, rank, messages, sums in packed:
            if self.tamper is not None:
                tampered = self.tamper(bucket.index, rank, torch.cat(messages))
                if tampered is not None:
                    messages = list(tampered.split([int(m.numel()) for m in messages]))
            dest = self._engine_rank(i, rank)
            works += [isend(m, dest, group=self.group) for m in (*messages, encode_sums(sums, device)) if m.numel()]
            self._partial["done"].add((i, rank))
            refs.extend(messages)
            self.stats.bytes_sent += sum(int(m.numel()) for m in messages)
        self._partial = None
        self._next += 1
        self._open_vote(bucket, listings, list(self._requests), works, refs, started)

    def _release(self, bucket: Bucket, listings: list, sizes, done: set) -> list:
        """:meth:`abort`'s zeros: for every engine rank this sender owes parts of ``bucket`` and has
        not sent them, zeros of each part's size and zero checksums (voted down by the sender)."""
        works: list = []
        device = group_device(self.group)
        for i in range(len(self.engines)):
            for rank in range(self.plan.engine_layout.tp_size):
                mine = self.parts.mine(bucket, i, rank, self.me)
                if not mine or (i, rank) in done:
                    continue
                zeros = [torch.zeros(p.nbytes, dtype=torch.uint8, device=device) for p in mine]
                width = DIGEST_CHARS[self._algo or checksum_algo(device)]
                zeros.append(torch.zeros(len(mine) * width, dtype=torch.uint8, device=device))
                works += [isend(z, self._engine_rank(i, rank), group=self.group) for z in zeros if z.numel()]
        return works


class OwnerFeed:
    """What :meth:`WeightSynchronizer._push` iterates with owner senders, in place of the gatherer:
    each bucket of this rank's stage with this rank's own shards (nothing gathered or converted)."""

    def __init__(self, plan, stage: int, local: Mapping[str, torch.Tensor]) -> None:
        from megarl.weight_sync.gather import GatherTimings

        self.plan, self.stage, self.local = plan, stage, local
        self.timings = GatherTimings()

    def iter_hf_buckets(self):
        """The stage's buckets in order, each with this rank's local shards (nothing gathered)."""
        for bucket in self.plan.stage_buckets(self.stage):
            yield bucket, self.local, None

    def send_contributions(self) -> int:
        """Bytes sent to a stage sender for gathering: none, every owner sends its own parts."""
        return 0
