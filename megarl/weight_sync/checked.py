"""Transports whose engine side is megarl's receiver loader: a checked bucket, every time.

Both create one process group between the stage's senders (ranks ``0 .. n - 1``: the stage
sender, then, for ``p2p`` with segment senders, the other trainer ranks that send segments) and
every engine rank (NCCL on GPU, gloo on CPU: same code) inside the first sync and reuse it. Per sync the sender
announces
every bucket of its stage at once, by one ticket to the custom loader
:func:`megarl.weight_sync.receiver.receive_shards` (an upstream extension point:
``--custom-weight-loader`` + ``/update_weights_from_tensor``'s ``load_format``; the listings come
from the plan, metadata only), so no HTTP hop sits between two buckets. Per bucket it checksums
every tensor (:mod:`megarl.weight_sync.wire`), sends the bytes and then the checksums, and every
group rank votes; the engines load only if every rank received intact tensors the served
checkpoint knows (name, dtype, shape). They differ in what each engine rank receives:

- :class:`~megarl.weight_sync.p2p.P2PTransport` (``p2p``): exactly its own slices, point to point (shard to shard);
- :class:`~megarl.weight_sync.p2p.CheckedDistributedTransport` (``distributed`` when the engines registered the
  receiver): every tensor whole, one broadcast per bucket, loaded by SGLang's own
  ``load_weights`` (which slices it), as ``/update_weights_from_distributed`` does.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megarl.training.collectives import all_reduce, group_device, isend
from megarl.weight_sync.engine_clients import wait_all
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.receiver_group import ReceiverGroupTransport
from megarl.weight_sync.specs import torch_dtype
from megarl.weight_sync.wire import DIGEST_CHARS, STATUS, VOTE_FIELDS, encode_sums


def _nbytes(listing: list) -> int:
    """Bytes of the tensors ``[[name, dtype, shape, ...]]`` back to back."""
    return sum(torch.Size(shape).numel() * torch_dtype(dtype).itemsize for _, dtype, shape, *_ in listing)


class CheckedTransport(ReceiverGroupTransport):
    """Announce a stage, send its buckets with checksums, vote on each, release the receivers on
    failure (module docstring; the protocol in :class:`~megarl.weight_sync.p2p.P2PTransport`'s).
    Subclasses say what each engine rank receives (:meth:`_listings`, :meth:`_packed`) and how it
    travels (:meth:`_transfer`).
    """

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self.tamper = None
        self._pending: dict | None = None
        self._failure: WeightSyncError | None = None
        self._finish_announced = False
        """This sync's stage ticket went out: the receivers join the ``finish`` vote after its last bucket."""
        self._partial: dict | None = None
        """The bucket being sent: its handles and the engine ranks its bytes went to (for :meth:`abort`)."""
        self._stage: list[tuple[Any, list[list] | None, list[list[int]] | None]] | None = None
        """This sync's announced buckets, each engine rank's listing ``[[name, dtype, shape]]`` and
        message sizes ``[[nbytes]]`` (owner senders: rounds, a tuple of buckets each, and None, None:
        each sender's parts)."""
        self._next = 0
        """Index in ``_stage`` of the next bucket the receivers wait for."""
        self._algo: str | None = None
        tp = plan.engine_layout.tp_size
        self.received = [[0] * tp for _ in range(len(engines))]
        """Bytes each engine rank reported receiving this sync ``[engine][tp_rank]`` (counted by the receiver)."""

    def start_sync(self) -> None:
        """Reset the per-sync state: transfer statistics, the stage's announced buckets, and the bytes
        each engine rank reported receiving.
        """
        super().start_sync()
        self._finish_announced = False
        self._stage, self._next, self._partial = None, 0, None
        self.received = [[0] * self.plan.engine_layout.tp_size for _ in range(len(self.engines))]

    def _sizes(self, bucket: Bucket, listings: list[list]) -> list[list[int]]:
        """Bytes of each message each engine rank receives of ``bucket`` (the segment owners' runs
        when buckets are laid out per engine rank; else one message of its listing's bytes)."""
        if self._owners is not None:
            return self._owners.message_sizes(bucket)
        return [[_nbytes(listing)] for listing in listings]

    def _listings(self, bucket: Bucket) -> list[list]:
        """Each engine rank's ticket listing ``[[name, dtype, shape]]`` of ``bucket`` (wire order),
        from the plan alone (the tensors' metadata)."""
        raise NotImplementedError

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, list, list]]:
        """``(rank, messages [[nbytes] uint8, ...], listing [[name, dtype, shape, checksum]])`` for
        each engine rank this sender sends, in order, packed lazily."""
        raise NotImplementedError

    def send(self, bucket: Bucket, tensors, flat) -> None:
        """Pack, send point to point and open the vote of one bucket; the stage's first bucket also
        announces the stage (see class docstring).

        Raises:
            WeightSyncError: ``bucket`` is not the next announced one, or its tensors differ from the
                plan's (names, dtypes, shapes); the receivers were released first (:meth:`abort`).
        """
        if self._pp_rank is None:
            raise WeightSyncError("p2p transport used before connect()")
        if self.group is None:
            self._join()
        if self._failure is not None:  # a bucket was refused: send nothing more (drain raises)
            return
        started = time.perf_counter()
        packed: Iterable[tuple[int, list, list]]
        if self._stage is None:  # announce the stage; the first bucket's bytes leave as each rank is packed
            self._announce(bucket)
            packed = self._packed(bucket, tensors, flat)
        else:  # pack while the previous bucket moves; send after its vote
            packed = list(self._packed(bucket, tensors, flat))
            self._wait_vote()  # the previous bucket: its buffers are free, the receivers wait for this one
            if self._failure is not None:
                return
        listings, sizes = self._announced(bucket)
        works: list = []
        buffers: list = []
        device = group_device(self.group)
        self._partial = {"bucket": bucket, "works": works, "done": set()}  # abort() finishes it
        for rank, buffer, listing in packed:
            if not self._is_mine(bucket, rank):
                raise WeightSyncError(f"p2p sender {self.sender_index}: handed engine rank {rank}'s segment of "
                                      f"bucket {bucket.index}, which another sender owns")
            if [entry[:3] for entry in listing] != listings[rank]:
                self.abort()
                wrong = next((a, b) for a, b in zip([e[:3] for e in listing] + [None] * len(listings[rank]),
                                                    listings[rank] + [None] * len(listing)) if a != b)
                raise WeightSyncError(f"p2p sender: bucket {bucket.index} engine rank {rank}: converted tensor "
                                      f"{wrong[0]} where the plan announced {wrong[1]}")
            if [int(m.numel()) for m in buffer] != sizes[rank]:
                raise WeightSyncError(f"p2p sender: bucket {bucket.index} engine rank {rank}: messages of "
                                      f"{[int(m.numel()) for m in buffer]} bytes, the ticket announced {sizes[rank]}")
            if self.tamper is not None:
                joined = torch.cat(buffer) if len(buffer) > 1 else buffer[0]
                tampered = self.tamper(bucket.index, rank, joined)
                buffer = buffer if tampered is None else list(tampered.split(sizes[rank]))
            works += self._transfer(rank, buffer, encode_sums([entry[3] for entry in listing], device))
            self._partial["done"].add(rank)
            buffers.extend(buffer)
        self._partial = None
        self._next += 1
        self.stats.bytes_sent += sum(int(b.numel()) for b in buffers) * len(self.engines)
        self._open_vote(bucket, listings, list(self._requests), works, buffers, started)

    def _announced(self, bucket: Bucket) -> tuple[list[list], list[list[int]]]:
        """The announced listings and message sizes of ``bucket``, the next bucket the receivers wait for.

        Raises:
            WeightSyncError: no stage was announced, or ``bucket`` is not the next announced one (the
                receivers were released first), or it was announced without message sizes.
        """
        stage = self._stage
        if stage is None:  # _announce sets it
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} sent before its stage was announced")
        expected = stage[self._next][0] if self._next < len(stage) else None
        # by index: a block-FP8 sender sends the quantiser's wire copy of the plan's bucket (WireQuantizer)
        if expected is None or expected.index != bucket.index:
            self.abort()
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} is not the next announced one "
                                  f"({expected.index if expected is not None else 'none left'})")
        _, listings, sizes = stage[self._next]
        if sizes is None or listings is None:  # only owner senders announce none, and they send with their own send()
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} was announced without message sizes")
        return listings, sizes

    def _announce(self, bucket: Bucket) -> None:
        """Submit the stage ticket (the stage sender; the other senders only take note): every
        bucket of this stage from ``bucket`` on, each engine rank's listing without checksums
        (those follow the bytes) and, with several senders, which group rank sends it."""
        from megarl.weight_sync.wire import checksum_algo

        self._algo = checksum_algo(group_device(self.group))  # the same on every sender of the stage
        stage = [b for b in self.plan.buckets if b.sender_rank == bucket.sender_rank and b.index >= bucket.index]
        announced = [(b, listings, self._sizes(b, listings)) for b in stage for listings in [self._listings(b)]]
        self._stage = list(announced)
        self._next = 0
        self._finish_announced = True
        if self.sender_index:
            return
        tickets = [{"op": "stage", "mode": self.mode, "group": self.group_name, "algo": self._algo,
                    "proof": self.load_proof,
                    "buckets": [dict({"bucket": b.index, "nbytes": _nbytes(listings[rank]), "tensors": listings[rank]},
                                     **({"source": self._source(b, rank)} if self._owners is not None else {}),
                                     **({"messages": sizes[rank]} if len(sizes[rank]) > 1 else {}))
                                for b, listings, sizes in announced]}
                   for rank in range(self.plan.engine_layout.tp_size)]
        self._submit_tickets(tickets)

    def abort(self) -> None:
        """Release the receivers after this sender failed mid-stage (call before raising).

        They wait for the next announced bucket: each engine rank gets a bucket of zeros of the
        announced size and the sender votes it down (status 8), so no engine loads it and every
        receiver returns; the group stays usable for the next sync. Nothing to do when no stage is
        announced, every bucket was sent, or a vote already failed (the receivers returned).
        """
        if self._stage is None and len(self.senders) > 1:  # the other senders wait for this one
            if self.group is None and self.sender_index == 0:
                self._handoff({"failed": True})  # they wait for the group's name
                return
            try:
                if self.group is None:
                    self._join_helper()
                self._announce(self._buckets[0])
            except Exception:  # noqa: BLE001 - the caller's error is the one to report
                return
        if self._stage is None or self.group is None:
            return
        partial, self._partial = self._partial, None
        works, done = (partial["works"], partial["done"]) if partial is not None else ([], set())
        if partial is None:  # between buckets: the previous one's vote decides whether anyone waits
            try:
                self._wait_vote()
            except WeightSyncError:  # an engine failed: it will not receive anything more
                self._next, self._failure = len(self._stage), None
                return
            refused, self._failure = self._failure is not None, None  # the caller raises its own error
            if refused or self._next >= len(self._stage):  # refused: the receivers returned already
                return
        bucket, listings, sizes = self._stage[self._next]
        self._next = len(self._stage)
        works += self._release(bucket, listings or [], sizes or [], done)
        self._open_vote(bucket, listings, list(self._requests), works, None, time.perf_counter(),
                        sender_status=8)
        try:
            self._wait_vote()
        except WeightSyncError:
            pass
        self._failure = None
        requests, self._requests = self._requests, []
        try:
            wait_all(requests, self.timeout_s)
        except Exception:  # noqa: BLE001 - the caller's error is the one to report
            pass

    def _release(self, bucket: Bucket, listings: list, sizes: list, done: set) -> list:
        """:meth:`abort`'s zeros for every engine rank of ``bucket`` this sender owes bytes and has
        not sent them (``done``): each announced message as zeros, zero checksums; the handles."""
        if self._algo is None:  # _announce sets it
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} released before its stage was announced")
        works: list = []
        device = group_device(self.group)
        for rank, listing in enumerate(listings):
            if rank in done or not self._is_mine(bucket, rank):  # real bytes went there, or another sender's
                continue
            zeros = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes[rank]]
            sums = torch.zeros(len(listing) * DIGEST_CHARS[self._algo], dtype=torch.uint8, device=device)
            works += self._transfer(rank, zeros, sums)
        return works

    def _released(self, bucket: Bucket | None, engine: int, rank: int, stopped: set) -> bool:
        """Engine ``engine`` rank ``rank``'s bytes of ``bucket`` came (in part) from a sender in
        ``stopped`` (group ranks that stopped mid-stage and sent zeros)."""
        return self._source(bucket, rank) in stopped

    def _transfer(self, rank: int, messages: list, sums: torch.Tensor) -> list:
        """Start sending engine rank ``rank`` of every engine its bytes (``messages``, in order),
        then its checksums ``sums``; returns the handles."""
        return [isend(message, self._engine_rank(i, rank), group=self.group)
                for i in range(len(self.engines)) for message in (*messages, sums) if message.numel()]

    def _open_vote(self, bucket, listings, futures, works, refs, started, *, sender_status: int = 0) -> None:
        votes = torch.zeros(self.world_size, VOTE_FIELDS, dtype=torch.int64, device=group_device(self.group))
        votes[self.sender_index, 0] = sender_status
        work = all_reduce(votes, group=self.group, async_op=True)
        self._pending = {"bucket": bucket, "listings": listings, "futures": futures, "works": works,
                         "refs": refs, "votes": votes, "work": work, "started": started}

    def _wait_vote(self) -> None:
        """Wait for the open vote; raise naming the tensor if any engine rank refused."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._await_work(pending["work"], pending["futures"], "the p2p ticket vote")
        for w in pending["works"]:
            w.wait()
        if pending["bucket"] is not None:  # the finish vote's wait is loading time (counted by drain)
            self.stats.transfer_s += time.perf_counter() - pending["started"]
        votes = pending["votes"].cpu()
        tp = self.plan.engine_layout.tp_size
        problems = [f"trainer rank {self.senders[k]} (sender {k} of the group): {STATUS.get(int(status), status)}"
                    for k, status in enumerate(votes[:self.n_senders, 0].tolist())
                    if status and k != self.sender_index]  # this sender's own error is raised by its caller
        stopped = {k for k, status in enumerate(votes[:self.n_senders, 0].tolist()) if status == 8}
        for i in range(len(self.engines)):
            for r in range(tp):
                status, index, received, at_bucket = votes[self._engine_rank(i, r)].tolist()
                self.received[i][r] += received
                if status and self._released(pending["bucket"], i, r, stopped):
                    continue  # the zeros a stopped sender released this rank with: not a second error
                if status:
                    problems.append(f"engine {i} ({self.engines.urls[i]}) rank {r}: "
                                    f"{self._refused_tensor(pending, r, index, at_bucket)}: "
                                    f"{STATUS.get(status, status)}")
        self.stats.engine_rank_bytes = [max(row[r] for row in self.received) for r in range(tp)]
        if problems:  # raised by drain(): the other trainer ranks must still finish their gather
            self._failure = WeightSyncError(f"p2p weight sync {self._refused_where(pending)}: " + "; ".join(problems))

    def _refused_tensor(self, pending: dict, rank: int, index: int, at_bucket: int) -> str:
        """The tensor an engine rank's vote names: ``index`` in its listing of the pending bucket
        (of bucket ``at_bucket`` for the finish vote)."""
        listing = pending["listings"][rank] if pending["bucket"] is not None else self._listing(at_bucket, rank)
        what = (f"{listing[index][0]} (sent {listing[index][1]} {tuple(listing[index][2])})"
                if index < len(listing) else "its bucket")
        return what if pending["bucket"] is not None or at_bucket < 0 else f"bucket {at_bucket}: {what}"

    def _refused_where(self, pending: dict) -> str:
        """Which vote failed, for the error."""
        if pending["bucket"] is None:
            return "failed at loading"
        return f"refused at bucket {pending['bucket'].index}, no engine loaded it"

    def _listing(self, bucket_index: int, rank: int) -> list:
        """Engine rank ``rank``'s listing of the plan's bucket ``bucket_index`` ([] when none)."""
        bucket = next((b for b in self.plan.buckets if b.index == bucket_index), None)
        return self._listings(bucket)[rank] if bucket is not None else []

    def drain(self) -> None:
        """Wait for the last vote, then a ``finish`` vote (loading errors), then every ticket's answer."""
        if self.group is None:  # nothing was sent
            return
        self._wait_vote()
        started = time.perf_counter()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            requests, self._requests = self._requests, []
            wait_all(requests, self.timeout_s)
            raise failure
        futures = list(self._requests) if self._finish_announced or self.sender_index else self._submit_tickets(
            [{"op": "finish", "group": self.group_name}] * self.plan.engine_layout.tp_size)
        self._open_vote(None, [[] for _ in range(self.plan.engine_layout.tp_size)], futures, [], None, started)
        self._wait_vote()
        requests, self._requests = self._requests, []
        wait_all(requests, self.timeout_s)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        self.stats.engine_load_s += time.perf_counter() - started
