"""What every transport is: the :class:`Transport` base class, the options a run gives one
(:class:`TransportOptions`) and :class:`GroupTransport`, the base of those that send over a
process group with the engine ranks.

The transports themselves: :mod:`megarl.weight_sync.sglang_transports` (``distributed`` as SGLang does
it, ``shard``, ``tensor``, ``disk``) and :mod:`megarl.weight_sync.p2p` (``p2p`` and the checked
``distributed``); the registry of them by name (and what each declares):
:mod:`megarl.config.sync_transports`; which one a sync uses: :mod:`megarl.weight_sync.choice`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import torch

from megarl.weight_sync.engine_clients import EngineClients, wait_all
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.stacked_experts import stack_expert_slices


@dataclass(frozen=True)
class TransportOptions:
    """What a run tells a transport besides the plan and the engines (each takes what it needs)."""

    backend: str = "auto"
    """Group transports: ``auto`` (nccl with CUDA, else gloo), ``nccl`` or ``gloo``."""
    master_address: str = "127.0.0.1"
    """Group transports: the sender's address, which the engines connect to."""
    port_base: int | None = None
    """Group transports: the group's port is the first free one at or above it on the sender's node,
    within ``megarl.procs.ports.PORT_SPAN`` (``cluster.master_port``: the range a firewalled
    trainer node opens); None: the allocator's own start below the ephemeral range."""
    directory: str | os.PathLike | None = None
    """``disk``: where the safetensors files are written."""
    timeout_s: float = 600.0
    """Seconds before a transfer or an engine's answer is declared failed."""
    load_proof: bool = True
    """Checked transports: the engines read each ``p2p`` bucket back from their parameters after
    loading it (:mod:`megarl.weight_sync.load_proof`; ``weight_sync.load_proof``)."""


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

    def __init__(self, plan: WeightSyncPlan, engines: EngineClients, *, timeout_s: float = 600.0) -> None:
        self.plan, self.engines, self.timeout_s = plan, engines, timeout_s
        self.stats = TransferStats(engine_rank_bytes=[0] * plan.engine_layout.tp_size)
        self._in_flight: tuple | None = None

    @classmethod
    def from_options(cls, plan: WeightSyncPlan, engines: EngineClients, options: TransportOptions) -> Self:
        """This transport for ``plan`` and ``engines``, taking what it needs of ``options``."""
        return cls(plan, engines, timeout_s=options.timeout_s)

    def connect(self, pp_rank: int) -> None:
        """One-time setup for the sender of stage ``pp_rank`` (called in stage order)."""

    def start_sync(self) -> None:
        """Start one sync: zero the transfer statistics (called on every sender before its first bucket)."""
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

    def _stacked(self, tensors, *, views_only: bool = False) -> list:
        """``tensors`` (``[(hf_name, tensor)]``) as SGLang's loader takes them: each complete run of
        an expert stack's slices as the stack (:func:`megarl.weight_sync.stacked_experts.stack_expert_slices`).

        Raises:
            WeightSyncError: ``views_only`` and a stack's slices are not back to back.
        """
        try:
            return stack_expert_slices(tensors, lambda _: self.plan.num_experts, views_only=views_only)
        except ValueError as err:
            raise WeightSyncError(f"{self.name}: {err}") from err

    def _count(self, per_rank_bytes: Sequence[int]) -> None:
        for r, n in enumerate(per_rank_bytes):
            self.stats.engine_rank_bytes[r] += n
        self.stats.bytes_sent += sum(per_rank_bytes) * len(self.engines)


class GroupTransport(Transport):
    """A transport over a process group of this stage's sender (rank 0) and every engine rank.

    Args (beyond `Transport`'s): backend: ``auto`` (nccl with CUDA, else gloo), ``nccl`` or
    ``gloo``; master_address: the sender's address, which the engines connect to; port_base: see
    :attr:`TransportOptions.port_base`.
    """

    ordered_stages = True

    def __init__(self, plan, engines, *, backend: str = "auto", master_address: str = "127.0.0.1",
                 port_base: int | None = None, timeout_s: float = 600.0) -> None:
        super().__init__(plan, engines, timeout_s=timeout_s)
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.master_address, self.port_base = master_address, port_base
        self.group = None
        self.group_name: str | None = None

    @classmethod
    def from_options(cls, plan, engines, options: TransportOptions) -> Self:
        """This transport for ``plan`` and ``engines`` with the group's backend, address, port base and
        timeout from ``options``.
        """
        return cls(plan, engines, backend=options.backend, master_address=options.master_address,
                   port_base=options.port_base, timeout_s=options.timeout_s)

    def group_port(self) -> int:
        """The port this stage's group rendezvous listens on (on :attr:`master_address`): from megarl's
        allocator, at or above :attr:`port_base` when set, reserved on this node.

        Raises:
            RuntimeError: no free port in ``[port_base, port_base + PORT_SPAN)`` (names the range).
        """
        from megarl.procs.ports import find_free_port

        return find_free_port(self.master_address, self.port_base)

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
