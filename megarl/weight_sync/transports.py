"""Transports: how a stage sender hands converted buckets to the SGLang engines.

- ``distributed``: a process group between this sender (group rank 0) and every engine rank,
  created through ``/init_weights_update_group`` (NCCL on GPU, gloo on CPU: same code); per bucket
  one ``/update_weights_from_distributed`` request with ``load_format="flattened_bucket"`` per
  engine and one broadcast of the flat bucket. Every engine rank receives every tensor in full.
- ``p2p``: shard to shard on any host: a process group between this sender (rank 0) and every
  engine rank (NCCL on GPU, gloo on CPU: same code), created once inside the first sync and
  reused; per bucket each engine rank receives exactly its slices point to point, announced by a
  ticket to the custom loader :func:`megarl.weight_sync.receiver.receive_shards` (an upstream
  extension point: ``--custom-weight-loader`` + ``/update_weights_from_tensor``'s ``load_format``),
  which checks per-tensor checksums, names, shapes and dtypes and loads only after every engine
  rank voted that its bytes are intact (:class:`P2PTransport`).
- ``shard``: per-rank payloads through ``/update_weights_from_tensor``: engine rank ``r`` receives
  exactly its slices (``plan.engine_slice``), loaded pre-sharded by the custom loader
  :func:`megarl.weight_sync.sglang_loader.load_presharded`; the tensors travel as shared memory,
  so ``shard`` is same-host only (``p2p`` is its cross-host form).
- ``auto``: ``p2p`` where it applies, else ``distributed`` (:func:`resolve_auto`); opt-in for now
  (``weight_sync.transport`` defaults to ``distributed``).
- ``tensor``: colocated whole tensors through ``/update_weights_from_tensor`` (CUDA IPC on GPU,
  shared memory on CPU); SGLang slices them.
- ``disk``: safetensors files + ``/update_weights_from_disk``: the fallback and the reference.

A transport never lets a buffer be reused while the engines may still read it. ``distributed``:
``send(b)`` first waits until bucket ``b - 1``'s broadcast completed (the engines then hold their
own copy, and have received ``b - 1``'s request, so requests stay in order); the engines load
``b - 1`` while ``b``'s request travels. ``shard`` / ``tensor``: the engines read the sender's
shared memory, so ``send(b)`` waits until they answered ``b - 1`` and keeps its tensors referenced
until then. Either way gathering and placing bucket ``b + 1`` overlaps the transfer of ``b``.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce, broadcast, group_device, isend
from megarl.weight_sync.engines import EngineGroup, wait_all
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.validate import WeightSyncError
from megarl.weight_sync.wire import STATUS, VOTE_FIELDS

LOADER = "megarl.weight_sync.sglang_loader.load_presharded"
"""``--custom-weight-loader`` import path of the shard transport's loader."""


@dataclass
class TransferStats:
    """What one sender's transport did in one sync."""

    transfer_s: float = 0.0
    """Moving bytes (broadcast, serialisation into shared memory, file writes)."""
    engine_load_s: float = 0.0
    """Waiting for the engines to load after the bytes moved."""
    bytes_sent: int = 0
    """Bytes handed to the engines (summed over engine ranks that receive them separately)."""
    engine_rank_bytes: list = field(default_factory=list)
    """Bytes received by each rank of one engine."""


class Transport:
    """Base class; one instance per stage sender (the coordinator also drives ``finish``)."""

    name = "base"
    needs_session = True
    """Wrap the push in ``/begin_weight_update`` ... ``/end_weight_update``."""
    ordered_stages = False
    """Stage senders must push one after another (they share collectives with the engines)."""

    def __init__(self, plan: WeightSyncPlan, engines: EngineGroup, *, timeout_s: float = 600.0) -> None:
        self.plan, self.engines, self.timeout_s = plan, engines, timeout_s
        self.stats = TransferStats(engine_rank_bytes=[0] * plan.engine_layout.tp_size)
        self._in_flight: Optional[tuple] = None

    def connect(self, pp_rank: int) -> None:
        """One-time setup for the sender of stage ``pp_rank`` (called in stage order)."""

    def start_sync(self) -> None:
        self.stats = TransferStats(engine_rank_bytes=[0] * self.plan.engine_layout.tp_size)

    def send(self, bucket: Bucket, tensors: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        """Hand one bucket to the engines; may return before they finished (see :meth:`drain`).

        Args:
            bucket: the plan's bucket.
            tensors: its HF tensors in wire order, as views of ``flat``.
            flat: ``[bucket.nbytes]`` uint8, the tensors back to back; not modified by the caller
                until this transport drained the bucket.
        """
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until the engines finished with every bucket sent so far."""
        if self._in_flight is None:
            return
        futures, refs, started, moved_at = self._in_flight
        wait_all(futures, self.timeout_s)
        done = time.perf_counter()
        self.stats.transfer_s += moved_at - started
        self.stats.engine_load_s += done - moved_at
        self._in_flight = None
        del refs  # the engines are done: the bucket's buffers may go

    def finish(self, weight_version: str) -> None:
        """Coordinator only, after every sender drained (the disk transport reloads here)."""

    def close(self) -> None:
        """Release transport resources (process groups)."""

    def _count(self, per_rank_bytes: Sequence[int]) -> None:
        for r, n in enumerate(per_rank_bytes):
            self.stats.engine_rank_bytes[r] += n
        self.stats.bytes_sent += sum(per_rank_bytes) * len(self.engines)


class _GroupTransport(Transport):
    """A transport over a process group of this stage's sender (rank 0) and every engine rank.

    Args (beyond `Transport`'s): backend: ``auto`` (nccl with CUDA, else gloo), ``nccl`` or
    ``gloo``; master_address: the sender's address, which the engines connect to.
    """

    ordered_stages = True

    def __init__(self, plan, engines, *, backend: str = "auto", master_address: str = "127.0.0.1",
                 timeout_s: float = 600.0) -> None:
        super().__init__(plan, engines, timeout_s=timeout_s)
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.master_address = master_address
        self.group = None
        self.group_name: Optional[str] = None


class DistributedTransport(_GroupTransport):
    """Broadcast flat buckets over a group with all engine ranks (see module docstring)."""

    name = "distributed"

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self._broadcast: Optional[tuple] = None
        self._requests: list = []

    def connect(self, pp_rank: int) -> None:
        """Create this stage's group: this sender is rank 0, engine ``i`` rank ``r`` is ``1 + i*T + r``."""
        from megarl.rollout.engine import find_free_port
        from megarl.weight_sync.sglang_compat import init_custom_process_group

        tp = self.plan.engine_layout.tp_size
        world = 1 + len(self.engines) * tp
        port = find_free_port(self.master_address)
        self.group_name = f"megarl-wsync-pp{pp_rank}-{uuid.uuid4().hex[:8]}"
        futures = [self.engines.submit(i, "init_weights_update_group", master_address=self.master_address,
                                       master_port=port, rank_offset=1 + i * tp, world_size=world,
                                       group_name=self.group_name, backend=self.backend)
                   for i in range(len(self.engines))]
        self.group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{self.master_address}:{port}", world_size=world, rank=0,
            group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s))
        wait_all(futures, self.timeout_s)

    def send(self, bucket, tensors, flat) -> None:
        """Post the bucket's requests and broadcast; returns once the *previous* bucket's broadcast ended.

        Ordering: bucket ``b``'s requests are sent only after bucket ``b - 1``'s broadcast completed,
        i.e. after every engine rank joined it, so each engine received ``b - 1``'s request first and
        processes the two in order (it queues ``b`` while loading ``b - 1``: the load of one bucket
        overlaps the request latency of the next). Our flat buffer is free once its broadcast ended
        (the engines receive into their own buffers).
        """
        if self.group is None:
            raise WeightSyncError("distributed transport used before connect()")
        self._wait_broadcast()
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        started = time.perf_counter()
        futures = self.engines.submit_all("update_weights_from_distributed", names, dtypes, shapes,
                                          group_name=self.group_name, flush_cache=False,
                                          load_format="flattened_bucket")
        self._requests.extend(futures)
        self._broadcast = (broadcast(flat, 0, group=self.group, async_op=True), futures, started, flat)
        self._count([bucket.nbytes] * self.plan.engine_layout.tp_size)

    def _wait_broadcast(self) -> None:
        if self._broadcast is None:
            return
        work, futures, started, _flat = self._broadcast
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:  # the engine refused the bucket and will never join this broadcast
                raise WeightSyncError(f"engine rejected a weight bucket: {failed[0].exception()}; "
                                      f"the update group {self.group_name} is now unusable")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"broadcast not finished within {self.timeout_s} s")
            time.sleep(0.0005)
        work.wait()
        self.stats.transfer_s += time.perf_counter() - started
        self._broadcast = None

    def drain(self) -> None:
        """Wait for the last broadcast, then for every engine to answer every bucket's request."""
        self._wait_broadcast()
        started = time.perf_counter()
        requests, self._requests = self._requests, []
        wait_all(requests, self.timeout_s)
        self.stats.engine_load_s += time.perf_counter() - started  # loads not hidden behind a transfer

    def close(self) -> None:
        if self.group is not None:
            try:
                self.engines.call_all("destroy_weights_update_group", group_name=self.group_name, timeout_s=60)
            finally:
                dist.destroy_process_group(self.group)
                self.group = None


class _TensorPayloadTransport(Transport):
    """Shared code of ``shard`` and ``tensor``: one ``/update_weights_from_tensor`` per engine."""

    load_format: Optional[str] = None

    def _payloads(self, bucket: Bucket, tensors) -> tuple[list[list[tuple[str, torch.Tensor]]], list[int]]:
        raise NotImplementedError

    def send(self, bucket, tensors, flat) -> None:
        from megarl.rollout.client import serialize_named_tensors

        self.drain()
        started = time.perf_counter()
        per_rank, nbytes = self._payloads(bucket, tensors)
        serialized = [serialize_named_tensors(p) for p in per_rank]  # moves CPU tensors to shared memory
        moved = time.perf_counter()
        futures = self.engines.submit_all("update_weights_from_tensor", serialized, load_format=self.load_format,
                                          flush_cache=False)
        self._in_flight = (futures, (per_rank, serialized), started, moved)
        self._count(nbytes)


class ShardTransport(_TensorPayloadTransport):
    """Each engine rank receives exactly its slices (see module docstring)."""

    name = "shard"
    load_format = LOADER

    def _payloads(self, bucket, tensors):
        layout = self.plan.engine_layout
        per_rank: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(layout.tp_size)]
        nbytes = [0] * layout.tp_size
        for (name, tensor), spec in zip(tensors, bucket.hf_tensors):
            parts: dict = {}  # one copy per distinct slice (replicated slices are shared by ranks)
            for rank, sl in sorted(self.plan.engine_slices_of(spec).items()):
                key = (sl.axis, sl.start, sl.stop)
                if key not in parts:
                    view = tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)
                    # A copy of exactly the slice: a view would share (and ship) the whole storage.
                    parts[key] = view.clone(memory_format=torch.contiguous_format)
                per_rank[rank].append((name, parts[key]))
                nbytes[rank] += parts[key].numel() * parts[key].element_size()
        return per_rank, nbytes


class TensorTransport(_TensorPayloadTransport):
    """Colocated engines: whole tensors to every rank; SGLang slices them."""

    name = "tensor"

    def _payloads(self, bucket, tensors):
        whole = [(n, t.contiguous()) for n, t in tensors]
        size = sum(t.numel() * t.element_size() for _, t in whole)
        return [whole] * self.plan.engine_layout.tp_size, [size] * self.plan.engine_layout.tp_size


class P2PTransport(_GroupTransport):
    """Shard-to-shard over a process group with every engine rank, any host (see module docstring).

    Per bucket: each engine rank's slices are packed (no copy when a rank holds every tensor
    whole), checksummed per tensor, announced by a ticket (``/update_weights_from_tensor`` with
    ``load_format`` = the receiver loader) and sent point to point; then every group rank joins a
    vote (one all-reduce) and the engines load only if every rank received intact, expected
    tensors (:mod:`megarl.weight_sync.receiver`). The next bucket's tickets go out only after the
    previous vote, so every engine rank sees the tickets in order; packing bucket ``b + 1`` and
    gathering ``b + 2`` overlap the transfer of ``b``, and the engines load ``b`` while ``b + 1``'s
    ticket travels.

    ``tamper``: for fault-injection tests only: ``tamper(bucket_index, engine_tp_rank, buffer)``
    is called after the checksums and may return a replacement buffer to send to that rank.
    """

    name = "p2p"

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self.tamper = None
        self._pool: dict[tuple[int, int], torch.Tensor] = {}  # (slot, engine rank) -> packing buffer, kept across syncs
        self._pending: Optional[dict] = None
        self._failure: Optional[WeightSyncError] = None
        self._pp_rank: Optional[int] = None
        self._requests: list = []
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
        self.group_name = f"megarl-p2p-pp{self._pp_rank}-{uuid.uuid4().hex[:8]}"
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
        self.received = [[0] * self.plan.engine_layout.tp_size for _ in range(len(self.engines))]

    def _pack(self, bucket: Bucket, tensors, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[list], str]:
        """Each engine rank's bytes ``[nbytes_r]`` uint8, its ticket tensor list
        ``[[name, dtype, shape, checksum]]`` (wire order) and the checksum algorithm."""
        from megarl.weight_sync.wire import checksum, checksum_algo

        tp = self.plan.engine_layout.tp_size
        parts: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(tp)]
        for (name, tensor), spec in zip(tensors, bucket.hf_tensors):
            for rank, sl in self.plan.engine_slices_of(spec).items():
                parts[rank].append((name, tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)))
        flat_device = flat.device
        algo = checksum_algo(flat_device)
        sums: dict[tuple, str] = {}
        buffers, listings = [], []
        whole = [t for _, t in tensors]
        for rank in range(tp):
            mine = parts[rank]
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
            buffers.append(buffer)
            listings.append(listing)
        return buffers, listings, algo

    def send(self, bucket, tensors, flat) -> None:
        """Pack, announce, send point to point and open the vote of one bucket (see class docstring)."""
        if self._pp_rank is None:
            raise WeightSyncError("p2p transport used before connect()")
        if self.group is None:
            self._join()
        if self._failure is not None:  # a bucket was refused: send nothing more (drain raises)
            return
        started = time.perf_counter()
        buffers, listings, algo = self._pack(bucket, tensors, flat)
        self._wait_vote()  # the previous bucket: its tickets were processed first, its buffers are free
        if self._failure is not None:
            return
        if self.tamper is not None:
            tampered = [self.tamper(bucket.index, r, b) for r, b in enumerate(buffers)]
            buffers = [b if t is None else t for b, t in zip(buffers, tampered)]
        tickets = [{"op": "bucket", "group": self.group_name, "bucket": bucket.index,
                    "nbytes": int(b.numel()), "algo": algo, "tensors": listing}
                   for b, listing in zip(buffers, listings)]
        futures = self._submit_tickets(tickets)
        tp = self.plan.engine_layout.tp_size
        works = [isend(buffers[r], 1 + i * tp + r, group=self.group)
                 for i in range(len(self.engines)) for r in range(tp) if buffers[r].numel()]
        self.stats.bytes_sent += sum(int(b.numel()) for b in buffers) * len(self.engines)
        self._open_vote(bucket, listings, futures, works, buffers, started)

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
        work, futures = pending["work"], pending["futures"]
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                raise WeightSyncError(f"engine rejected a p2p ticket: {failed[0].exception()}; "
                                      f"the update group {self.group_name} is now unusable")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"p2p vote not finished within {self.timeout_s} s")
            time.sleep(0.0005)
        work.wait()
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
        futures = self._submit_tickets([{"op": "finish", "group": self.group_name}] * self.plan.engine_layout.tp_size)
        self._open_vote(None, [[] for _ in range(self.plan.engine_layout.tp_size)], futures, [], None, started)
        self._wait_vote()
        requests, self._requests = self._requests, []
        wait_all(requests, self.timeout_s)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        self.stats.engine_load_s += time.perf_counter() - started

    def close(self) -> None:
        """Destroy the group on both sides (the engines' side inside a short update session)."""
        if self.group is None:
            return
        try:
            self.engines.call_all("begin_weight_update", timeout_s=60)
            try:
                self._submit_tickets([{"op": "close", "group": self.group_name}] * self.plan.engine_layout.tp_size)
                requests, self._requests = self._requests, []
                wait_all(requests, 60)
            finally:
                self.engines.call_all("end_weight_update", timeout_s=60)
        finally:
            dist.destroy_process_group(self.group)
            self.group = None


class DiskTransport(Transport):
    """Write buckets as safetensors; the coordinator then has every engine reload the directory."""

    name = "disk"
    needs_session = False

    def __init__(self, plan, engines, *, directory: str | os.PathLike, timeout_s: float = 600.0) -> None:
        super().__init__(plan, engines, timeout_s=timeout_s)
        self.directory = Path(directory)

    def start_sync(self) -> None:
        super().start_sync()
        self.directory.mkdir(parents=True, exist_ok=True)

    def send(self, bucket, tensors, flat) -> None:
        from safetensors.torch import save_file

        started = time.perf_counter()
        # save_file refuses tensors sharing storage (q/k/v views of one fused tensor): copy.
        save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in tensors},
                  str(self.directory / f"bucket-{bucket.index:05d}.safetensors"))
        self.stats.transfer_s += time.perf_counter() - started
        self._count([bucket.nbytes] * self.plan.engine_layout.tp_size)

    def finish(self, weight_version: str) -> None:
        started = time.perf_counter()
        expected = {f"bucket-{b.index:05d}.safetensors" for b in self.plan.buckets}
        for stale in self.directory.glob("*.safetensors"):
            if stale.name not in expected:
                stale.unlink()
        self.engines.call_all("update_weights_from_disk", str(self.directory), flush_cache=False,
                              weight_version=weight_version, timeout_s=self.timeout_s)
        self.stats.engine_load_s += time.perf_counter() - started


def make_transport(name: str, plan: WeightSyncPlan, engines: EngineGroup, *, backend: str = "auto",
                   master_address: str = "127.0.0.1", directory: str | os.PathLike | None = None,
                   timeout_s: float = 600.0) -> Transport:
    """The transport called ``name`` (``weight_sync.transport``; ``auto``: see :func:`resolve_auto`).

    Raises:
        ValueError: unknown name, or ``disk`` without a directory.
    """
    if name == "auto":
        name = resolve_auto(plan, engines, backend=backend, timeout_s=timeout_s)
    if name == "p2p":
        return P2PTransport(plan, engines, backend=backend, master_address=master_address, timeout_s=timeout_s)
    if name == "distributed":
        return DistributedTransport(plan, engines, backend=backend, master_address=master_address,
                                    timeout_s=timeout_s)
    if name == "shard":
        return ShardTransport(plan, engines, timeout_s=timeout_s)
    if name == "tensor":
        return TensorTransport(plan, engines, timeout_s=timeout_s)
    if name == "disk":
        if directory is None:
            raise ValueError("weight_sync.transport=disk needs a directory for the safetensors files")
        return DiskTransport(plan, engines, directory=directory, timeout_s=timeout_s)
    raise ValueError(f"weight_sync.transport: unknown {name!r} (auto, p2p, distributed, shard, tensor, disk)")


def resolve_auto(plan: WeightSyncPlan, engines: EngineGroup, *, backend: str = "auto", timeout_s: float = 60.0) -> str:
    """``weight_sync.transport=auto``: ``p2p`` where it applies and is not predicted slower, else ``distributed``.

    ``p2p`` applies when every engine registered the receiver loader (``/server_info``'s
    ``custom_weight_loader``; megarl registers it in engines it starts) and SGLang can load every
    tensor pre-sharded at this engine layout (the plan's engine slices). It is chosen with gloo
    (whose broadcast sends the whole bucket to every engine rank separately, so ``p2p`` moves
    ``1 / T`` of the bytes) and with NCCL for one engine; with NCCL and several engines a pipelined
    broadcast carries each byte once per link while one ``p2p`` sender sends each engine its
    shards one after another (``megarl plan-sync`` shows both), so ``distributed`` stays.
    """
    from megarl.weight_sync.plan import PlanError
    from megarl.weight_sync.receiver import RECEIVER

    try:
        plan.engine_shard_bytes()
    except PlanError:
        return "distributed"
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    if backend == "nccl" and len(engines) > 1:
        return "distributed"
    infos = wait_all(engines.submit_all("_request", "GET", "/server_info", timeout_s=timeout_s), timeout_s)
    ok = all(RECEIVER in (info.get("custom_weight_loader") or []) for info in infos)
    return "p2p" if ok else "distributed"




def engine_custom_weight_loaders(transport: str) -> list[str]:
    """What engines megarl starts itself register with ``--custom-weight-loader`` for ``transport``
    (``auto`` registers the ``p2p`` receiver, so that ``auto`` resolves to ``p2p`` for them)."""
    from megarl.weight_sync.receiver import RECEIVER

    if transport == "shard":
        return [LOADER]
    if transport in ("auto", "p2p"):
        return [LOADER, RECEIVER]
    return []
