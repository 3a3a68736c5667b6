"""Transports whose engine side is megarl's receiver loader: a checked bucket, every time.

Both create one process group between the stage sender (rank 0) and every engine rank (NCCL on
GPU, gloo on CPU: same code) inside the first sync and reuse it. Per bucket the sender checksums
every tensor (:mod:`megarl.weight_sync.wire`), announces the bucket by a ticket to the custom
loader :func:`megarl.weight_sync.receiver.receive_shards` (an upstream extension point:
``--custom-weight-loader`` + ``/update_weights_from_tensor``'s ``load_format``), sends the bytes
and then the checksums, and every group rank votes; the engines load only if every rank received intact tensors the
served checkpoint knows (name, dtype, shape). They differ in what each engine rank receives:

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
from megarl.weight_sync.gather import torch_dtype
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.transports import _GroupTransport
from megarl.weight_sync.validate import WeightSyncError
from megarl.weight_sync.wire import STATUS, VOTE_FIELDS, encode_sums


class P2PTransport(_GroupTransport):
    """Shard-to-shard over a process group with every engine rank, any host (see module docstring).

    Per bucket: announced by a ticket (``/update_weights_from_tensor`` with ``load_format`` = the
    receiver loader; names, dtypes, shapes), each engine rank's slices packed (no copy when a rank
    holds every tensor whole), checksummed per tensor and sent point to point, the checksums right
    after the bytes; then every group rank joins a vote (one all-reduce) and the engines load only
    if every rank received intact, expected tensors (:mod:`megarl.weight_sync.receiver`). A ticket
    goes out as soon as the order allows: the first bucket's before it is packed (the engines'
    HTTP hop overlaps the packing), the next ones only after the previous vote, so every engine
    rank sees the tickets in order; packing bucket ``b + 1`` and gathering ``b + 2`` overlap the
    transfer of ``b``, and the engines load ``b`` while ``b + 1``'s ticket travels. The stage's
    last ticket carries ``finish``: the receivers join the finish vote (loading errors) after
    loading it, without another request.

    ``tamper``: for fault-injection tests only: ``tamper(bucket_index, engine_tp_rank, buffer)``
    is called after the checksums and may return a replacement buffer to send to that rank.
    """

    name = "p2p"
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
        """The last bucket's ticket asked the receivers for the ``finish`` vote after loading it."""
        self._last_by_sender: Optional[dict[int, int]] = None
        """Sender rank -> index of its last bucket in the plan (made on first use)."""
        tp = plan.engine_layout.tp_size
        self.received = [[0] * tp for _ in range(len(engines))]
        """Bytes each engine rank reported receiving this sync ``[engine][tp_rank]`` (counted by the receiver)."""

    @property
    def world_size(self) -> int:
        return 1 + len(self.engines) * self.plan.engine_layout.tp_size

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

    def _join(self) -> None:
        """Create this stage's group: this sender is rank 0, engine ``i`` rank ``r`` is ``1 + i*T + r``."""
        import concurrent.futures

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
                                       [payload(dict(ticket, rank_offset=1 + i * tp))] * tp,
                                       load_format=RECEIVER, flush_cache=False)
                   for i in range(len(self.engines))]
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
        self.received = [[0] * self.plan.engine_layout.tp_size for _ in range(len(self.engines))]

    def _slices(self, bucket: Bucket, tensors) -> list[list[tuple[str, torch.Tensor]]]:
        """Each engine rank's ``[(name, view)]`` of the bucket (wire order), views of ``tensors``."""
        parts: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(self.plan.engine_layout.tp_size)]
        for (name, tensor), spec in zip(tensors, bucket.hf_tensors):
            for rank, sl in self.plan.engine_slices_of(spec).items():
                parts[rank].append((name, tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)))
        return parts

    def _listings(self, bucket: Bucket, tensors) -> list[list]:
        """Each engine rank's ticket listing ``[[name, dtype, shape]]`` (wire order), before packing."""
        return [[[name, str(v.dtype).removeprefix("torch."), list(v.shape)] for name, v in mine]
                for mine in self._slices(bucket, tensors)]

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, list]]:
        """``(rank, bytes [nbytes_r] uint8, listing [[name, dtype, shape, checksum]])`` for each engine
        rank in order, packed lazily (a rank's bytes may leave while the next rank's are packed)."""
        from megarl.weight_sync.wire import checksum, checksum_algo

        parts = self._slices(bucket, tensors)
        flat_device = flat.device
        algo = checksum_algo(flat_device)
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
            yield rank, buffer, listing

    def send(self, bucket, tensors, flat) -> None:
        """Announce, pack, send point to point and open the vote of one bucket (see class docstring)."""
        if self._pp_rank is None:
            raise WeightSyncError("p2p transport used before connect()")
        if self.group is None:
            self._join()
        if self._failure is not None:  # a bucket was refused: send nothing more (drain raises)
            return
        started = time.perf_counter()
        packed = self._packed(bucket, tensors, flat)
        if self._pending is None:  # no vote open: announce now; each rank's bytes leave once packed
            futures = self._announce(bucket, tensors, flat)
        else:  # pack while the previous bucket moves; announce after its vote
            packed = list(packed)
            self._wait_vote()  # the previous bucket: its tickets were processed first, its buffers are free
            if self._failure is not None:
                return
            futures = self._announce(bucket, tensors, flat)
        works, buffers, listings = [], [], []
        device = group_device(self.group)
        for rank, buffer, listing in packed:
            if self.tamper is not None:
                tampered = self.tamper(bucket.index, rank, buffer)
                buffer = buffer if tampered is None else tampered
            works += self._transfer(rank, buffer, encode_sums([entry[3] for entry in listing], device))
            buffers.append(buffer)
            listings.append(listing)
        self.stats.bytes_sent += sum(int(b.numel()) for b in buffers) * len(self.engines)
        self._open_vote(bucket, listings, futures, works, buffers, started)
        self._finish_announced = bucket.index == self._last_index(bucket)

    def _last_index(self, bucket: Bucket) -> int:
        """Index of this stage sender's last bucket (the plan's buckets with the same sender)."""
        if self._last_by_sender is None:  # one pass over the plan, not one per bucket
            self._last_by_sender = {}
            for b in self.plan.buckets:
                self._last_by_sender[b.sender_rank] = max(b.index, self._last_by_sender.get(b.sender_rank, -1))
        return self._last_by_sender[bucket.sender_rank]

    def _announce(self, bucket: Bucket, tensors, flat: torch.Tensor) -> list:
        """Submit one bucket's tickets (listings without checksums: those follow the bytes); the
        stage's last bucket's ticket also asks for the ``finish`` vote after loading."""
        from megarl.weight_sync.wire import checksum_algo

        listings = self._listings(bucket, tensors)
        tickets = [{"op": "bucket", "mode": self.mode, "group": self.group_name, "bucket": bucket.index,
                    "nbytes": sum(torch.Size(shape).numel() * torch_dtype(dtype).itemsize for _, dtype, shape in listing),
                    "algo": checksum_algo(flat.device), "tensors": listing,
                    "finish": bucket.index == self._last_index(bucket)}
                   for listing in listings]
        return self._submit_tickets(tickets)

    def _transfer(self, rank: int, buffer: torch.Tensor, sums: torch.Tensor) -> list:
        """Start sending engine rank ``rank`` of every engine its bytes ``buffer``, then its checksums
        ``sums``; returns the handles."""
        tp = self.plan.engine_layout.tp_size
        return [isend(message, 1 + i * tp + rank, group=self.group)
                for i in range(len(self.engines)) for message in (buffer, sums) if message.numel()]

    def _open_vote(self, bucket, listings, futures, works, refs, started) -> None:
        votes = torch.zeros(self.world_size, VOTE_FIELDS, dtype=torch.int64, device=group_device(self.group))
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
        problems = []
        for i in range(len(self.engines)):
            for r in range(tp):
                status, index, received, _ = votes[1 + i * tp + r].tolist()
                self.received[i][r] += received
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
        futures = list(self._requests) if self._finish_announced else self._submit_tickets(
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
    mode = "broadcast"
    """The tickets' ``mode``: every engine rank joins one broadcast of the whole bucket."""

    def _packed(self, bucket: Bucket, tensors, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, list]]:
        """The flat bucket for every engine rank, and the listing ``[[name, dtype, shape, checksum]]``."""
        from megarl.weight_sync.wire import checksum, checksum_algo

        algo = checksum_algo(flat.device)
        listing = [[name, str(t.dtype).removeprefix("torch."), list(t.shape), checksum(t, algo)] for name, t in tensors]
        for rank in range(self.plan.engine_layout.tp_size):
            yield rank, flat, listing

    def _listings(self, bucket: Bucket, tensors) -> list[list]:
        """Every engine rank's listing: every tensor whole ``[[name, dtype, shape]]``."""
        listing = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]
        return [listing] * self.plan.engine_layout.tp_size

    def _transfer(self, rank: int, buffer: torch.Tensor, sums: torch.Tensor) -> list:
        """Engine rank 0's buffer (the whole bucket) goes to every engine rank in one broadcast, then
        its checksums in another; the other ranks' (the same) send nothing."""
        if rank != 0:
            return []
        return [broadcast(message, 0, group=self.group, async_op=True) for message in (buffer, sums)
                if message.numel()]
