"""The transports through SGLang's own weight-update endpoints: how a stage sender hands converted
buckets to the SGLang engines without megarl's receiver loader.

This module holds ``distributed`` as SGLang does it, ``shard``, ``tensor`` and ``disk``; the
transports checked by megarl's receiver (``p2p``, checked ``distributed``) are in
:mod:`megarl.weight_sync.p2p`, their base class in :mod:`megarl.weight_sync.transport`, and the
registry that names each (and what it declares) in :mod:`megarl.config.sync_transports`.

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
- ``auto`` (the default): ``p2p`` where it applies, else ``distributed``
  (:func:`megarl.weight_sync.choice.resolve_auto`);
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

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist

from megarl.training.collectives import broadcast
from megarl.weight_sync.engine_clients import wait_all
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.transport import GroupTransport, Transport, TransportOptions

LOADER = "megarl.weight_sync.sglang_loader.load_presharded"
"""``--custom-weight-loader`` import path of the shard transport's loader."""


class DistributedTransport(GroupTransport):
    """Broadcast flat buckets over a group with all engine ranks (see module docstring)."""

    name = "distributed"

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self._broadcast: tuple | None = None
        self._requests: list = []

    def connect(self, pp_rank: int) -> None:
        """Create this stage's group: this sender is rank 0, engine ``i`` rank ``r`` is ``1 + i*T + r``."""
        from megarl.weight_sync.sglang_compat import init_custom_process_group

        tp = self.plan.engine_layout.tp_size
        world = 1 + len(self.engines) * tp
        port = self.group_port()
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
        tensors = self._stacked(tensors, views_only=True)  # SGLang's flattened bucket: its bytes as they lie
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
        """Destroy the weight-update group on the engines and here (the group is gone even when the
        engines' call fails).
        """
        if self.group is not None:
            try:
                self.engines.call_all("destroy_weights_update_group", group_name=self.group_name, timeout_s=60)
            finally:
                dist.destroy_process_group(self.group)
                self.group = None


class _TensorPayloadTransport(Transport):
    """Shared code of ``shard`` and ``tensor``: one ``/update_weights_from_tensor`` per engine."""

    load_format: str | None = None

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
                key = (sl.axis, sl.spans())
                if key not in parts:
                    view = sl.take(tensor)
                    # A copy of exactly the slice: a view would share (and ship) the whole storage.
                    parts[key] = view.clone(memory_format=torch.contiguous_format)
                per_rank[rank].append((name, parts[key]))
                nbytes[rank] += parts[key].numel() * parts[key].element_size()
        return [self._stacked(p) for p in per_rank], nbytes


class TensorTransport(_TensorPayloadTransport):
    """Colocated engines: whole tensors to every rank; SGLang slices them."""

    name = "tensor"

    def _payloads(self, bucket, tensors):
        whole = [(n, t.contiguous()) for n, t in self._stacked(tensors)]
        size = sum(t.numel() * t.element_size() for _, t in whole)
        return [whole] * self.plan.engine_layout.tp_size, [size] * self.plan.engine_layout.tp_size


class DiskTransport(Transport):
    """Write buckets as safetensors; the coordinator then has every engine reload the directory."""

    name = "disk"
    needs_session = False

    def __init__(self, plan, engines, *, directory: str | os.PathLike, timeout_s: float = 600.0) -> None:
        super().__init__(plan, engines, timeout_s=timeout_s)
        self.directory = Path(directory)

    @classmethod
    def from_options(cls, plan, engines, options: TransportOptions) -> Self:
        """``disk`` writes into ``options.directory``.

        Raises:
            ValueError: ``options.directory`` is None.
        """
        if options.directory is None:
            raise ValueError("weight_sync.transport=disk needs a directory for the safetensors files")
        return cls(plan, engines, directory=options.directory, timeout_s=options.timeout_s)

    def start_sync(self) -> None:
        """Start one sync: zero the statistics and create the directory."""
        super().start_sync()
        self.directory.mkdir(parents=True, exist_ok=True)

    def send(self, bucket, tensors, flat) -> None:
        """Write ``bucket``'s tensors as ``bucket-<index>.safetensors`` in the directory (copied to the
        CPU first: safetensors refuses views sharing storage).
        """
        from safetensors.torch import save_file

        started = time.perf_counter()
        # save_file refuses tensors sharing storage (q/k/v views of one fused tensor): copy.
        save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in self._stacked(tensors)},
                  str(self.directory / f"bucket-{bucket.index:05d}.safetensors"))
        self.stats.transfer_s += time.perf_counter() - started
        self._count([bucket.nbytes] * self.plan.engine_layout.tp_size)

    def finish(self, weight_version: str) -> None:
        """Remove files of buckets this plan does not have, then have every engine load the directory
        (``update_weights_from_disk`` with ``weight_version``).

        Raises:
            megarl.rollout.engine_errors.EngineRequestError: an engine refused the load (the first
                engine's error is raised).
        """
        started = time.perf_counter()
        expected = {f"bucket-{b.index:05d}.safetensors" for b in self.plan.buckets}
        for stale in self.directory.glob("*.safetensors"):
            if stale.name not in expected:
                stale.unlink()
        self.engines.call_all("update_weights_from_disk", str(self.directory), flush_cache=False,
                              weight_version=weight_version, timeout_s=self.timeout_s)
        self.stats.engine_load_s += time.perf_counter() - started
