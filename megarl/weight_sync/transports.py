"""Transports: how a stage sender hands converted buckets to the SGLang engines.

- ``distributed``: one broadcast of the flat bucket per bucket over a process group between this
  sender (group rank 0) and every engine rank (NCCL on GPU, gloo on CPU: same code). Every engine
  rank receives every tensor in full. Where the engines registered megarl's receiver loader (as
  engines megarl starts do) the bucket is announced to it with per-tensor checksums and checked on
  every engine rank before any loads (:class:`megarl.weight_sync.p2p.CheckedDistributedTransport`);
  elsewhere it is SGLang's own path (:class:`DistributedTransport`: the group created through
  ``/init_weights_update_group``, per bucket one ``/update_weights_from_distributed`` request with
  ``load_format="flattened_bucket"`` per engine), which SGLang loads unchecked.
- ``p2p``: shard to shard on any host: the receiver's group, and per bucket each engine rank
  receives exactly its slices point to point, checked the same way
  (:class:`megarl.weight_sync.p2p.P2PTransport`).
- ``shard``: per-rank payloads through ``/update_weights_from_tensor``: engine rank ``r`` receives
  exactly its slices (``plan.engine_slice``), loaded pre-sharded by the custom loader
  :func:`megarl.weight_sync.sglang_loader.load_presharded`; the tensors travel as shared memory,
  so ``shard`` is same-host only (``p2p`` is its cross-host form).
- ``auto`` (the default): ``p2p`` where it applies, else ``distributed`` (:func:`megarl.weight_sync.choice.resolve_auto`);
  ``tensor`` for colocated engines on CUDA (:func:`megarl.weight_sync.choice.run_transport`).
- ``tensor``: colocated whole tensors through ``/update_weights_from_tensor`` (CUDA IPC on GPU,
  shared memory on CPU); SGLang slices them.
- ``disk``: safetensors files + ``/update_weights_from_disk``: the fallback and the reference.

A transport never lets a buffer be reused while the engines may still read it. ``distributed``
(SGLang's path; the checked transports wait for the previous bucket's vote, see :mod:`megarl.weight_sync.p2p`):
``send(b)`` first waits until bucket ``b - 1``'s broadcast completed (the engines then hold their
own copy, and have received ``b - 1``'s request, so requests stay in order); the engines load
``b - 1`` while ``b``'s request travels. ``shard`` / ``tensor``: the engines read the sender's
shared memory, so ``send(b)`` waits until they answered ``b - 1`` and keeps its tensors referenced
until then. Either way gathering and placing bucket ``b + 1`` overlaps the transfer of ``b``.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megarl.training.collectives import broadcast
from megarl.weight_sync.engines import EngineGroup, wait_all
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.validate import WeightSyncError

log = logging.getLogger(__name__)

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


ANSWERED_GRACE_S = 30.0
"""How long a group collective may stay open after an engine answered the request that joins it
(the engine will not join any more: its side failed)."""


class Transport:
    """Base class; one instance per stage sender (the coordinator also drives ``finish``)."""

    name = "base"
    needs_session = True
    """Wrap the push in ``/begin_weight_update`` ... ``/end_weight_update``."""
    ordered_stages = False
    """Stage senders must push one after another (they share collectives with the engines)."""
    sliced_buckets = False
    """``send`` accepts buckets laid out per engine rank (:class:`~megarl.weight_sync.segments.RankSlices`)."""

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

    def abort(self) -> None:
        """The sender failed between buckets: leave the engines able to take the next sync (the
        caller raises its error afterwards). Nothing to do for transports whose engines wait for
        no further bucket."""

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

    def _await_work(self, work, futures, what: str) -> None:
        """Wait for the group collective ``work`` (the sender's side of a bucket or a vote) while
        the engines' HTTP requests (``futures``) are in flight.

        Raises:
            WeightSyncError: an engine request failed (that engine will never join the collective:
                the group is now unusable), or ``work`` did not finish within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        answered_at = None
        while not work.is_completed():
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                raise WeightSyncError(f"engine rejected {what}: {failed[0].exception()}; "
                                      f"the update group {self.group_name} is now unusable")
            if answered_at is None and any(f.done() for f in futures):
                answered_at = time.monotonic()
            if answered_at is not None and time.monotonic() > answered_at + ANSWERED_GRACE_S:
                raise WeightSyncError(f"an engine answered its request but did not join {what} within "
                                      f"{ANSWERED_GRACE_S:g} s (its receiver failed, see the engine's log); "
                                      f"the update group {self.group_name} is now unusable")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what} not finished within {self.timeout_s} s")
            time.sleep(0.0005)
        work.wait()


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
        self._await_work(work, futures, "the weight bucket broadcast")
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

    ``distributed`` is checked per bucket (:class:`~megarl.weight_sync.p2p.CheckedDistributedTransport`)
    when every engine registered megarl's receiver loader, as engines megarl starts do; otherwise it
    is SGLang's own ``/update_weights_from_distributed`` (:class:`DistributedTransport`), which
    loads what it received unchecked (README, "A sync that checks itself"), and a warning says so.

    Raises:
        ValueError: unknown name, or ``disk`` without a directory.
    """
    from megarl.weight_sync.p2p import CheckedDistributedTransport, P2PTransport

    from megarl.weight_sync.choice import engines_have_receiver, resolve_auto
    from megarl.weight_sync.receiver import RECEIVER

    if name == "auto":
        name = resolve_auto(plan, engines, backend=backend, timeout_s=timeout_s)
        log.info("weight_sync.transport=auto -> %s (%d engine(s) for this sender)", name, len(engines))
    if name == "p2p":
        return P2PTransport(plan, engines, backend=backend, master_address=master_address, timeout_s=timeout_s)
    if name == "distributed":
        checked = engines_have_receiver(engines, timeout_s=timeout_s)
        if not checked:
            log.warning("weight_sync.transport=distributed: the engines did not register megarl's receiver "
                        "(--custom-weight-loader %s): buckets are loaded without a per-bucket checksum check",
                        RECEIVER)
        cls = CheckedDistributedTransport if checked else DistributedTransport
        return cls(plan, engines, backend=backend, master_address=master_address, timeout_s=timeout_s)
    if name == "shard":
        return ShardTransport(plan, engines, timeout_s=timeout_s)
    if name == "tensor":
        return TensorTransport(plan, engines, timeout_s=timeout_s)
    if name == "disk":
        if directory is None:
            raise ValueError("weight_sync.transport=disk needs a directory for the safetensors files")
        return DiskTransport(plan, engines, directory=directory, timeout_s=timeout_s)
    raise ValueError(f"weight_sync.transport: unknown {name!r} (auto, p2p, distributed, shard, tensor, disk)")
