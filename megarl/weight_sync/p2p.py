"""Transports whose engine side is megarl's receiver loader: a checked bucket, every time.

Both create one process group between the stage's senders (ranks ``0 .. n - 1``: the stage
sender, then, for ``p2p`` with segment senders, the other trainer ranks that send segments) and
every engine rank (NCCL on GPU, gloo on CPU: same code) inside the first sync and reuse it. Per sync the sender announces
every bucket of its stage at once, by one ticket to the custom loader
:func:`megarl.weight_sync.receiver.receive_shards` (an upstream extension point:
``--custom-weight-loader`` + ``/update_weights_from_tensor``'s ``load_format``; the listings come
from the plan, metadata only), so no HTTP hop sits between two buckets. Per bucket it checksums
every tensor (:mod:`megarl.weight_sync.wire`), sends the bytes and then the checksums, and every
group rank votes; the engines load only if every rank received intact tensors the served
checkpoint knows (name, dtype, shape). They differ in what each engine rank receives:

- :class:`P2PTransport` (``p2p``): exactly its own slices, point to point (shard to shard);
- :class:`CheckedDistributedTransport` (``distributed`` when the engines registered the
  receiver): every tensor whole, one broadcast per bucket, loaded by SGLang's own
  ``load_weights`` (which slices it), as ``/update_weights_from_distributed`` does.
"""
from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce, broadcast, group_device, isend
from megarl.weight_sync.engines import wait_all
from megarl.weight_sync.segments import torch_dtype
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.transports import _GroupTransport
from megarl.weight_sync.validate import WeightSyncError
from megarl.weight_sync.wire import DIGEST_CHARS, STATUS, VOTE_FIELDS, encode_sums


def _nbytes(listing: list) -> int:
    """Bytes of the tensors ``[[name, dtype, shape, ...]]`` back to back."""
    return sum(torch.Size(shape).numel() * torch_dtype(dtype).itemsize for _, dtype, shape, *_ in listing)


class P2PTransport(_GroupTransport):
    """Shard-to-shard over a process group with every engine rank, any host (see module docstring).

    Per sync: one ticket per engine rank (``/update_weights_from_tensor`` with ``load_format`` =
    the receiver loader) announces every bucket of the stage (names, dtypes, shapes of that rank's
    slices, from the plan), before the first bucket is packed, so the engines' HTTP hop overlaps
    the packing and no other request follows until the stage is done. Per bucket: each engine
    rank's slices (a :class:`~megarl.weight_sync.segments.RankSlices` bucket, laid out per engine
    rank by the gatherer: each rank's segment as it is; an HF-layout bucket: packed, with no copy
    when a rank holds every tensor whole), checksummed per tensor and sent point to point, the checksums right after the bytes; then every group rank joins a
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
        self.tamper = None
        self._pool: dict[tuple[int, int], torch.Tensor] = {}  # (slot, engine rank) -> packing buffer, kept across syncs
        self._pending: Optional[dict] = None
        self._failure: Optional[WeightSyncError] = None
        self._pp_rank: Optional[int] = None
        self._requests: list = []
        self._finish_announced = False
        """This sync's stage ticket went out: the receivers join the ``finish`` vote after its last bucket."""
        self._partial: Optional[dict] = None
        """The bucket being sent: its handles and the engine ranks its bytes went to (for :meth:`abort`)."""
        self._stage: Optional[list[tuple[Bucket, list[list]]]] = None
        """This sync's announced buckets and each engine rank's listing ``[[name, dtype, shape]]``."""
        self._next = 0
        """Index in ``_stage`` of the next bucket the receivers wait for."""
        self._algo: Optional[str] = None
        self.senders: list[int] = []
        """The stage's sending trainer ranks (global), stage sender first (:meth:`set_senders`); empty: one sender."""
        self.sender_index = 0
        """This rank's position in ``senders`` = its rank in the group (0: the stage sender)."""
        self._control = None
        self._owners = None
        self._buckets: list[Bucket] = []
        tp = plan.engine_layout.tp_size
        self.received = [[0] * tp for _ in range(len(engines))]
        """Bytes each engine rank reported receiving this sync ``[engine][tp_rank]`` (counted by the receiver)."""

    @property
    def n_senders(self) -> int:
        """Trainer ranks in the group: the stage sender and the helpers (ranks ``0 .. n - 1``)."""
        return max(1, len(self.senders))

    @property
    def world_size(self) -> int:
        return self.n_senders + len(self.engines) * self.plan.engine_layout.tp_size

    def set_senders(self, senders: list[int], index: int, control, owners, buckets: list[Bucket]) -> None:
        """Several senders per stage (before the first sync; every sender of the stage calls it).

        Args:
            senders: the stage's sending trainer ranks (global), the stage sender first
                (:meth:`~megarl.weight_sync.segments.SegmentOwners.senders`).
            index: this rank's position in ``senders``; 0 creates the group and announces the stage.
            control: the trainer's gloo control group (the stage sender hands the group's name and
                port to the others over it).
            owners: the :class:`~megarl.weight_sync.segments.SegmentOwners`: who sends each segment.
            buckets: the stage's buckets, in order.
        """
        self.senders, self.sender_index, self._control = list(senders), index, control
        self._owners, self._buckets = owners, list(buckets)

    def _is_mine(self, bucket: Bucket, rank: int) -> bool:
        """This sender sends engine rank ``rank``'s segment of ``bucket``."""
        if self._owners is None:
            return True
        return self._owners.owners(bucket)[rank] == self.senders[self.sender_index]

    def _source(self, bucket: Optional[Bucket], rank: int) -> int:
        """Group rank of the sender of engine rank ``rank``'s segment of ``bucket`` (None: the finish vote)."""
        if self._owners is None or bucket is None:
            return 0
        return self.senders.index(self._owners.owners(bucket)[rank])

    def _engine_rank(self, engine: int, rank: int) -> int:
        """Group rank of engine ``engine``'s TP rank ``rank``."""
        return self.n_senders + engine * self.plan.engine_layout.tp_size + rank

    def _submit_tickets(self, per_rank: list[dict]) -> list:
        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.wire import payload

        payloads = [payload(t) for t in per_rank]
        futures = self.engines.submit_all("update_weights_from_tensor", payloads, load_format=RECEIVER,
                                          flush_cache=False)
        self._requests.extend(futures)
        return futures

    def connect(self, pp_rank: int) -> None:
        """Remember the stage; the group is created inside the first sync's update session
        (SGLang accepts ``/update_weights_from_tensor`` only between ``begin_weight_update`` and
        ``end_weight_update``), after this stage's turn came (stages connect in order)."""
        self._pp_rank = pp_rank

    def _handoff(self, info: Optional[dict]) -> Optional[dict]:
        """The stage sender sends ``info`` (the group's name, address, port; ``{"failed": True}``
        when it failed before creating it) to every other sender over the control group; the
        others return what they received."""
        import json

        from megarl.training.collectives import recv, send

        size = 1024
        if self.sender_index == 0:
            raw = json.dumps(info).encode()
            message = torch.zeros(size, dtype=torch.uint8)
            message[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            for helper in self.senders[1:]:
                send(message, helper, group=self._control, tag=7)
            return None
        message = torch.zeros(size, dtype=torch.uint8)
        recv(message, self.senders[0], group=self._control, tag=7)
        return json.loads(bytes(message.numpy()).rstrip(b"\0").decode())

    def _join_helper(self) -> None:
        """Join the stage sender's group as rank ``sender_index`` (its name and port come over the
        control group)."""
        from megarl.weight_sync.sglang_compat import init_custom_process_group

        info = self._handoff(None)
        if info.get("failed"):
            raise WeightSyncError(f"the stage sender (trainer rank {self.senders[0]}) failed before creating "
                                  f"the p2p group; see its error")
        self.group_name = info["group"]
        self.group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{info['address']}:{info['port']}", world_size=self.world_size,
            rank=self.sender_index, group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s))

    def _join(self) -> None:
        """Create this stage's group: the senders are ranks ``0 .. n - 1`` (the stage sender 0),
        engine ``i`` rank ``r`` is ``n + i*T + r``."""
        import concurrent.futures

        if self.sender_index:
            return self._join_helper()

        from megarl.rollout.engine import find_free_port
        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.sglang_compat import init_custom_process_group
        from megarl.weight_sync.wire import payload

        tp = self.plan.engine_layout.tp_size
        port = find_free_port(self.master_address)
        self.group_name = f"megarl-{self.mode}-pp{self._pp_rank}-{uuid.uuid4().hex[:8]}"
        ticket = {"op": "connect", "group": self.group_name, "address": self.master_address, "port": port,
                  "world": self.world_size, "backend": self.backend, "timeout_s": self.timeout_s}
        futures = [self.engines.submit(i, "update_weights_from_tensor",
                                       [payload(dict(ticket, rank_offset=self._engine_rank(i, 0)))] * tp,
                                       load_format=RECEIVER, flush_cache=False)
                   for i in range(len(self.engines))]
        if len(self.senders) > 1:
            self._handoff({"group": self.group_name, "address": self.master_address, "port": port})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # joining blocks: watch the engines meanwhile
            joined = pool.submit(init_custom_process_group, backend=self.backend,
                                 init_method=f"tcp://{self.master_address}:{port}", world_size=self.world_size,
                                 rank=0, group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s))
            deadline = time.monotonic() + self.timeout_s
            while not joined.done():
                failed = [f for f in futures if f.done() and f.exception() is not None]
                if failed or time.monotonic() > deadline:
                    raise WeightSyncError(f"engines did not join the p2p group {self.group_name}: "
                                          f"{failed[0].exception() if failed else 'timeout'}")
                time.sleep(0.01)
            self.group = joined.result()
        wait_all(futures, self.timeout_s)

    def start_sync(self) -> None:
        super().start_sync()
        self._finish_announced = False
        self._stage, self._next, self._partial = None, 0, None
        self.received = [[0] * self.plan.engine_layout.tp_size for _ in range(len(self.engines))]

    def _slices(self, bucket: Bucket, tensors) -> list[list[tuple[str, torch.Tensor]]]:
        """Each engine rank's ``[(name, view)]`` of the bucket (wire order), views of ``tensors``."""
        parts: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(self.plan.engine_layout.tp_size)]
        for (name, tensor), spec in zip(tensors, bucket.hf_tensors):
            for rank, sl in self.plan.engine_slices_of(spec).items():
                parts[rank].append((name, tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)))
        return parts

    def _sizes(self, bucket: Bucket, listings: list[list]) -> list[list[int]]:
        """Bytes of each message each engine rank receives of ``bucket`` (the segment owners' runs
        when buckets are laid out per engine rank; else one message of its listing's bytes)."""
        if self._owners is not None:
            return self._owners.message_sizes(bucket)
        return [[_nbytes(listing)] for listing in listings]

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
                key = (name, v.storage_offset(), tuple(v.shape))
                if key not in sums:
                    sums[key] = checksum(buffer[offset:offset + n], algo)
                listing.append([name, str(v.dtype).removeprefix("torch."), list(v.shape), sums[key]])
                offset += n
            yield rank, [buffer], listing

    def send(self, bucket, tensors, flat) -> None:
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
        if self._stage is None:  # announce the stage; the first bucket's bytes leave as each rank is packed
            self._announce(bucket)
            packed = self._packed(bucket, tensors, flat)
        else:  # pack while the previous bucket moves; send after its vote
            packed = list(self._packed(bucket, tensors, flat))
            self._wait_vote()  # the previous bucket: its buffers are free, the receivers wait for this one
            if self._failure is not None:
                return
        expected, listings, sizes = self._stage[self._next] if self._next < len(self._stage) else (None, None, None)
        if expected is not bucket:
            self.abort()
            raise WeightSyncError(f"p2p sender: bucket {bucket.index} is not the next announced one "
                                  f"({expected.index if expected is not None else 'none left'})")
        works, buffers = [], []
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

    def _announce(self, bucket: Bucket) -> None:
        """Submit the stage ticket (the stage sender; the other senders only take note): every
        bucket of this stage from ``bucket`` on, each engine rank's listing without checksums
        (those follow the bytes) and, with several senders, which group rank sends it."""
        from megarl.weight_sync.wire import checksum_algo

        self._algo = checksum_algo(group_device(self.group))  # the same on every sender of the stage
        stage = [b for b in self.plan.buckets if b.sender_rank == bucket.sender_rank and b.index >= bucket.index]
        self._stage = [(b, listings, self._sizes(b, listings)) for b in stage for listings in [self._listings(b)]]
        self._next = 0
        self._finish_announced = True
        if self.sender_index:
            return
        tickets = [{"op": "stage", "mode": self.mode, "group": self.group_name, "algo": self._algo,
                    "buckets": [dict({"bucket": b.index, "nbytes": _nbytes(listings[rank]), "tensors": listings[rank]},
                                     **({"source": self._source(b, rank)} if self._owners is not None else {}),
                                     **({"messages": sizes[rank]} if len(sizes[rank]) > 1 else {}))
                                for b, listings, sizes in self._stage]}
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
        device = group_device(self.group)
        for rank, listing in enumerate(listings):
            if rank in done or not self._is_mine(bucket, rank):  # real bytes went there, or another sender's
                continue
            zeros = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes[rank]]
            sums = torch.zeros(len(listing) * DIGEST_CHARS[self._algo], dtype=torch.uint8, device=device)
            works += self._transfer(rank, zeros, sums)
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
        problems = [f"trainer rank {self.senders[k]} (sender {k} of this stage): {STATUS.get(int(status), status)}"
                    for k, status in enumerate(votes[:self.n_senders, 0].tolist())
                    if status and k != self.sender_index]  # this sender's own error is raised by its caller
        stopped = {k for k, status in enumerate(votes[:self.n_senders, 0].tolist()) if status == 8}
        for i in range(len(self.engines)):
            for r in range(tp):
                status, index, received, _ = votes[self._engine_rank(i, r)].tolist()
                self.received[i][r] += received
                if status and self._source(pending["bucket"], r) in stopped:
                    continue  # the zeros a stopped sender released this rank with: not a second error
                if status:
                    listing = pending["listings"][r] if pending["bucket"] is not None else []
                    what = (f"{listing[index][0]} (sent {listing[index][1]} {tuple(listing[index][2])})"
                            if index < len(listing) else "its bucket")
                    problems.append(f"engine {i} ({self.engines.urls[i]}) rank {r}: {what}: {STATUS.get(status, status)}")
        self.stats.engine_rank_bytes = [max(row[r] for row in self.received) for r in range(tp)]
        if problems:  # raised by drain(): the other trainer ranks must still finish their gather
            where = f"bucket {pending['bucket'].index}" if pending["bucket"] is not None else "loading"
            self._failure = WeightSyncError(f"p2p weight sync refused at {where}, no engine loaded it: "
                                            + "; ".join(problems))

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

    def close(self) -> None:
        """Destroy the group on both sides (the engines' side inside a short update session).

        Raises:
            WeightSyncError: an engine kept another update session open for 60 s.
            EngineRequestError: an engine refused a request.
        """
        if self.group is None:
            return
        if self.sender_index:  # the stage sender closes the engines' side
            dist.destroy_process_group(self.group)
            self.group = None
            return
        try:
            self._open_close_session(timeout_s=60)
            try:
                self._submit_tickets([{"op": "close", "group": self.group_name}] * self.plan.engine_layout.tp_size)
                requests, self._requests = self._requests, []
                wait_all(requests, 60)
            finally:
                self.engines.call_all("end_weight_update", timeout_s=60)
        finally:
            dist.destroy_process_group(self.group)
            self.group = None

    def _open_close_session(self, *, timeout_s: float) -> None:
        """``/begin_weight_update`` on every engine, in engine order, waiting while another stage
        sender's close holds the engine's session (with PP > 1 every stage sender closes its own
        group at the same time; SGLang refuses a second open session). The same order for every
        sender: one that holds engine ``i`` already holds ``0 .. i - 1``, so none waits in a cycle."""
        from megarl.rollout.client import EngineRequestError

        deadline = time.monotonic() + timeout_s
        for i in range(len(self.engines)):
            while True:
                try:
                    wait_all([self.engines.submit(i, "begin_weight_update")], timeout_s)
                    break
                except EngineRequestError as err:
                    if "already open" not in str(err):
                        raise
                    if time.monotonic() > deadline:
                        raise WeightSyncError(f"engine {i} ({self.engines.urls[i]}) kept another weight-update "
                                              f"session open for {timeout_s} s; group {self.group_name} not closed "
                                              f"on the engines") from err
                    time.sleep(0.1)


class CheckedDistributedTransport(P2PTransport):
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

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, list]]:
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
