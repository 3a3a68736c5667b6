"""The ``p2p`` transport with owner senders (``weight_sync.senders: owner``): every trainer rank sends
the parts of the engine ranks' slices that :class:`~megarl.weight_sync.owners.OwnerParts` assigns
it, cut from its own shards; nothing is gathered; all pipeline stages deliver at once.

The protocol is :class:`~megarl.weight_sync.p2p.P2PTransport`'s (one group, one ticket per engine
rank and sync, per bucket the bytes then the checksums, then a vote of every group rank before
any engine loads, the finish vote with the load proof) with these differences: every trainer rank
of every stage is a sender in **one** group with every engine rank (the coordinator, group rank 0,
talks to the engines over HTTP), so each engine has one update request per sync whatever PP is
(SGLang serves one at a time: a group per stage made the stages take turns); the buckets travel in
rounds packed so that every link carries its share (:func:`~megarl.weight_sync.senders.plan_rounds`;
several buckets of a stage and of every stage): each sender sends its stage's buckets of the round
one after another without waiting (round by round, plan order inside a round:
:meth:`~megarl.weight_sync.owners.OwnerParts.stage_order`), each engine rank receives and checks all
of them, and one vote decides the round before any of its buckets loads (a sender whose stage has
no bucket in a round joins its vote with nothing to send); each engine's ticket is its own
(copies split the engines, so an engine rank's sources depend on the engine) and lists the engine
rank's parts with their source (:mod:`owners`); and each sender sends one checksum per part it
sent, after its parts, since no sender knows a whole slice. A sender that fails releases its
receivers with zeros and votes the round down (status 8): every stage stops at that round, none
waits for the others.
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
    """``p2p`` from every trainer rank, each sending only what it holds, all stages at once (module docstring).

    Every trainer rank calls :meth:`set_owner_senders` before the first sync and then
    :meth:`send` for every bucket of its stage with its own shards (``{global name: shard}``) in
    place of the converted tensors. ``stats.bytes_sent`` counts this rank's bytes (every engine).
    ``tamper(bucket_index, engine_tp_rank, buffer)``: fault injection, as ``P2PTransport``'s; the
    buffer is this sender's parts for that rank, back to back.
    """

    ordered_stages = False
    """The stages deliver at once through one group (no turn passing)."""

    def set_owner_senders(self, senders: list[int], index: int, control, parts: OwnerParts,
                          buckets: list[Bucket]) -> None:
        """Every trainer rank (``senders``: :meth:`OwnerParts.group_senders`; ``index``: this rank's
        position, 0 = the coordinator, which creates the group and submits the tickets;
        ``buckets``: this rank's stage's buckets)."""
        self.set_senders(senders, index, control, parts, buckets)
        self.parts = parts
        self.rounds = parts.rounds()
        self._by_index = {b.index: b for r in self.rounds for b in r}

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
                                          for b in bucket for p in self.parts.parts(b, engine, rank))

    def _refused_tensor(self, pending: dict, rank: int, index: int, at_bucket: int) -> str:
        """``bucket B: tensor`` (a round's vote names the bucket: several travel together)."""
        bucket = self._by_index.get(at_bucket)
        listing = self.parts.listings(bucket)[rank] if bucket is not None else []
        what = (f"{listing[index][0]} (sent {listing[index][1]} {tuple(listing[index][2])})"
                if index < len(listing) else "its bucket")
        return f"bucket {at_bucket}: {what}"

    def _refused_where(self, pending: dict) -> str:
        if pending["bucket"] is None:
            return "failed at loading"
        return (f"refused at round {self.rounds.index(pending['bucket'])} (buckets "
                f"{', '.join(str(b.index) for b in pending['bucket'])}), no engine loaded them")

    def _announce(self, bucket: Bucket | None = None) -> None:
        """Every round of the sync; the coordinator submits each engine's tickets (each engine
        rank's slices and parts of every bucket of every stage, and the rounds), the others only
        take note."""
        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.wire import payload

        self._algo = checksum_algo(group_device(self.group))
        self._stage = [(r, None, None) for r in self.rounds]
        self._next, self._finish_announced = 0, True
        if self.sender_index:
            return
        for i in range(len(self.engines)):
            tickets = [{"op": "stage", "mode": self.mode, "group": self.group_name, "algo": self._algo,
                        "proof": self.load_proof, "rounds": [len(r) for r in self.rounds],
                        "buckets": [self.parts.ticket_entry(b, i, rank, self.senders) for r in self.rounds for b in r]}
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
        """Send this rank's parts of ``bucket`` (its stage's next bucket: round by round, plan order
        within a round, :meth:`OwnerParts.stage_order`) to every engine rank that gets any; after
        the stage's last bucket of the round, open the round's vote (the first bucket of a round
        waits for the previous round's vote first). ``tensors``: this rank's shards ``{global
        name: shard}``; ``flat`` unused.

        Raises:
            WeightSyncError: ``bucket`` is not this stage's next bucket of the next announced round,
                or a shard this rank is assigned is missing or misshapen (the receivers were
                released first).
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
            self._announce()
        try:
            packed = self._pack(bucket, tensors)
        except WeightSyncError:
            self.abort()
            raise
        if self._partial is None:  # the stage's first bucket of a round
            if not first:
                self._wait_vote()
                if self._failure is not None:
                    return
            if not self._skip_to(bucket):
                return
            self._partial = {"bucket": None, "works": [], "done": set(), "refs": [], "sent": set(),
                             "started": started}
        stage = self._stage or []
        current = stage[self._next][0] if self._next < len(stage) else ()
        partial = self._partial
        partial["bucket"] = current
        mine = [b.index for b in current if b.pp_rank == bucket.pp_rank]
        expected = next((k for k in mine if k not in partial["sent"]), None)
        if bucket.index != expected:
            self.abort()
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} is not this stage's next bucket of the next "
                                  f"announced round ({expected if expected is not None else 'none left'})")
        self._send_packed(bucket, packed, partial)
        if bucket.index == mine[-1]:  # the stage's last bucket of the round: the round's vote
            self._partial = None
            self._next += 1
            self._open_vote(current, None, list(self._requests), partial["works"], partial["refs"], partial["started"])

    def _send_packed(self, bucket: Bucket, packed: list, partial: dict) -> None:
        """Start sending :meth:`_pack`'s messages of ``bucket`` (each engine rank's parts, then their
        checksums), recorded in the round's ``partial`` (handles, buffers, engine ranks served)."""
        device = group_device(self.group)
        for i, rank, messages, sums in packed:
            if self.tamper is not None:
                tampered = self.tamper(bucket.index, rank, torch.cat(messages))
                if tampered is not None:
                    messages = list(tampered.split([int(m.numel()) for m in messages]))
            dest = self._engine_rank(i, rank)
            partial["works"] += [isend(m, dest, group=self.group) for m in (*messages, encode_sums(sums, device))
                                 if m.numel()]
            partial["done"].add((bucket.index, i, rank))
            partial["refs"].extend(messages)
            self.stats.bytes_sent += sum(int(m.numel()) for m in messages)
        partial["sent"].add(bucket.index)

    def drain(self) -> None:
        """Join the votes of the rounds after this stage's last bucket (nothing to send), then the
        last vote, the finish vote and the tickets' answers (:meth:`CheckedTransport.drain`)."""
        if self._pp_rank is None:
            return
        if self.group is None:  # this stage had no bucket: the others still count on its votes
            self._join()
        if self._partial is not None and self._failure is None:  # a round left half sent: never by the feed
            left = [b.index for b in self._partial["bucket"] if b.pp_rank == self._pp_rank
                    and b.index not in self._partial["sent"]]
            self.abort()
            raise WeightSyncError(f"p2p sender: the sync ended before this stage's buckets {left} of its round")
        if self._stage is None and self._failure is None:
            self._announce()
        self._wait_vote()  # this stage's last round
        self._skip_to(None)
        super().drain()

    def _skip_to(self, bucket: Bucket | None) -> bool:
        """Join the votes of the rounds before the one holding ``bucket`` (None: every round left)
        with nothing to send (rounds without a bucket of this rank's stage); False when a vote
        failed meanwhile (the receivers returned: send nothing more)."""
        rounds = self._stage or []
        while self._failure is None and self._next < len(rounds):
            current = rounds[self._next][0]
            if bucket is not None and any(b.index == bucket.index for b in current):
                return True
            if bucket is not None and not any(b.index == bucket.index for r, _, _ in rounds[self._next:] for b in r):
                return True  # not announced at all: send() refuses it
            self._next += 1
            self._open_vote(current, None, list(self._requests), [], None, time.perf_counter())
            self._wait_vote()
        return self._failure is None

    def _release(self, bucket, listings: list, sizes, done: set) -> list:
        """:meth:`abort`'s zeros: for every bucket of the round ``bucket`` and engine rank this
        sender owes parts and has not sent them (``done``: ``(bucket index, engine, rank)``), zeros
        of each part's size and zero checksums (voted down by the sender)."""
        works: list = []
        device = group_device(self.group)
        for b in bucket:
            for i in range(len(self.engines)):
                for rank in range(self.plan.engine_layout.tp_size):
                    mine = self.parts.mine(b, i, rank, self.me)
                    if not mine or (b.index, i, rank) in done:
                        continue
                    zeros = [torch.zeros(p.nbytes, dtype=torch.uint8, device=device) for p in mine]
                    width = DIGEST_CHARS[self._algo or checksum_algo(device)]
                    zeros.append(torch.zeros(len(mine) * width, dtype=torch.uint8, device=device))
                    works += [isend(z, self._engine_rank(i, rank), group=self.group) for z in zeros if z.numel()]
        return works


class OwnerFeed:
    """What :meth:`WeightSynchronizer._push` iterates with owner senders, in place of the gatherer:
    each bucket of this rank's stage with this rank's own shards (nothing gathered or converted)."""

    def __init__(self, plan, stage: int, local: Mapping[str, torch.Tensor], order: list[Bucket] | None = None) -> None:
        from megarl.weight_sync.gather import GatherTimings

        self.plan, self.stage, self.local = plan, stage, local
        self.order = order if order is not None else list(plan.stage_buckets(stage))
        """The stage's buckets in send order (:meth:`OwnerParts.stage_order`; None: plan order)."""
        self.timings = GatherTimings()

    def iter_hf_buckets(self):
        """The stage's buckets in send order, each with this rank's local shards (nothing gathered)."""
        for bucket in self.order:
            yield bucket, self.local, None

    def send_contributions(self) -> int:
        """Bytes sent to a stage sender for gathering: none, every owner sends its own parts."""
        return 0
