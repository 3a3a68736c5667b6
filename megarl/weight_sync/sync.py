"""One weight sync, trainer -> SGLang engines: the ordering, the roles of the ranks, the metrics.

Every trainer rank calls :meth:`WeightSynchronizer.sync` (a collective over the trainer group).
Roles come from the plan: the *coordinator* (global rank 0, the sender of stage 0) drives the
engines; each stage's *sender* gathers, converts and sends its stage's buckets; the other ranks
holding shards of a stage send them to their sender (``weight_sync.senders: owner``: every rank of
a stage sends its own parts to the engines, nothing gathered: :mod:`megarl.weight_sync.owners`).
With several engines, ``plan.senders_per_stage`` complete copies (replicas) of every stage do this
side by side, replica ``k`` for the engines
``i % senders_per_stage == k`` (:meth:`WeightSyncPlan.for_replica`); the remaining data-parallel
replicas only join barriers.

Ordering of one sync (the steps of :meth:`WeightSynchronizer.sync`, in this order):

1. **pause** generation on every engine (``weight_sync.pause_mode``: retract | abort | in_place;
   with R3 in async mode ``abort`` only, the one that keeps sampling-time routes:
   ``megarl.config.validate.CONFLICTS``);
2. **push** every bucket (``/begin_weight_update`` ... ``/end_weight_update`` around it for the
   transports that need a session); with the group transports (``distributed``, ``p2p`` with
   segment or stage senders) the stages push one after another (a token passed from sender to
   sender over a gloo group, so that the next stage's host really waits for it) because each
   stage's group has its own update request and an engine serves one at a time; owner senders
   deliver every stage at once through one group (:mod:`megarl.weight_sync.owner_transport`);
   engines serving a block-FP8 checkpoint receive each bucket quantised to it
   (:mod:`megarl.weight_sync.fp8_wire`);
3. **flush** the engines' prefix cache (cached KV was computed with the old weights);
4. set the engines' **weight_version** to the policy version;
5. **continue** generation.

Group creation (:meth:`connect`) is deadlock-free for PP > 1 and many engines: the stages' groups
are created one at a time in stage order (a trainer barrier between two), and every engine joins
each group in the same order.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce, barrier, control_group
from megarl.training.collectives import recv as recv_tensor
from megarl.training.collectives import send as send_tensor
from megarl.weight_sync.choice import check_one_sender, make_transport
from megarl.weight_sync.engine_clients import EngineClients
from megarl.weight_sync.gather import RING_SLOTS, StageGatherer
from megarl.weight_sync.manifest_checks import (
    WeightSyncError,
    check_local_params,
    check_plan_against_manifest,
    required,
)
from megarl.weight_sync.owner_transport import OwnerFeed, OwnerTransport
from megarl.weight_sync.owners import OwnerParts, check_senders
from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.segments import SegmentOwners
from megarl.weight_sync.sync_metrics import reduce_sync_stats
from megarl.weight_sync.transport import Transport, TransportOptions


class WeightSynchronizer:
    """Executes a :class:`WeightSyncPlan` with one transport; one instance per trainer rank.

    Args:
        plan: the plan (identical on every rank).
        transport: ``distributed``, ``shard``, ``tensor`` or ``disk``.
        engine_urls: every engine that must receive the weights.
        rank: this rank in ``group`` (the trainer's process group).
        placement: the conversion as copy instructions (:class:`~megarl.weight_sync.copy_instructions.Placement`).
        manifest: the engines' checkpoint tensors (:func:`~megarl.weight_sync.manifest_checks.read_manifest`);
            None skips that check (engines on another host).
        pause_mode: ``retract``, ``abort`` or ``in_place``.
        group: the trainer's process group (default group if None).
        senders: ``weight_sync.senders``: ``owner`` (``p2p`` only: every rank of a stage sends
            the parts of the engine ranks' slices it holds, nothing gathered,
            :mod:`~megarl.weight_sync.owners`), ``segment`` (with ``p2p``, each engine rank's
            segment is assembled and sent by the trainer rank of the stage holding most of it,
            :class:`~megarl.weight_sync.segments.SegmentOwners`) or ``stage`` (the stage sender
            gathers and sends everything).
        transport_kwargs: ``backend``, ``master_address``, ``directory``, ``timeout_s``, ``load_proof``
            (:class:`~megarl.weight_sync.transport.TransportOptions`).
    """

    def __init__(self, plan: WeightSyncPlan, transport: str, engine_urls, *, rank: int, placement,
                 manifest: Mapping | None = None, pause_mode: str = "retract",
                 group: dist.ProcessGroup | None = None, senders: str = "segment",
                 **transport_kwargs) -> None:
        if pause_mode not in ("retract", "abort", "in_place"):
            raise ValueError(f"weight_sync.pause_mode must be retract | abort | in_place, got {pause_mode!r}")
        check_senders(senders, transport=transport, quantized=plan.quantization is not None)
        if manifest is not None:
            check_plan_against_manifest(plan, manifest)
        check_one_sender(transport, plan)
        self.plan, self.rank, self.group, self.pause_mode = plan, rank, group, pause_mode
        # Barriers and the stages' turn token are control plane: a gloo group, so that they block the
        # host (under NCCL a recv returns before the token arrived). Collective: every rank builds it.
        self.control = control_group(group)
        self.placement = placement
        replica = 0 if senders == "owner" else plan.trainer_layout.replica_of(rank)  # owner: every copy sends
        self.mine: WeightSyncPlan | None = plan.for_replica(replica) if replica < plan.senders_per_stage else None
        """This rank's replica's plan (its senders, sources and engines); None: the rank only joins barriers."""
        buckets = self.mine.buckets if self.mine is not None else ()
        self.owner = senders == "owner"
        """Owner senders: every rank of a stage sends what it holds (:mod:`~megarl.weight_sync.owners`)."""
        per_stage = plan.trainer_layout.world_size // plan.trainer_layout.pp_size
        self.stage = rank // per_stage if self.owner else next(
            (b.pp_rank for b in buckets if b.sender_rank == rank or b.contributions(rank)), None)
        self.is_sender = any(b.sender_rank == rank for b in buckets)
        self.is_coordinator = rank == plan.trainer_layout.sender_rank(0)
        self.engines = EngineClients(engine_urls) if self.is_coordinator else None
        """Every engine (coordinator only): pause, sessions, flush, version, resume, verify."""
        self.transport: Transport | None = None
        self._transport_engines: EngineClients | None = None
        if self.mine is not None and (self.is_sender or (self.owner and self.stage is not None)):
            self._transport_engines = EngineClients([engine_urls[i] for i in required(self.mine.engines, "engines")])
            self.transport = (OwnerTransport.from_options(self.mine, self._transport_engines,
                                                          TransportOptions(**transport_kwargs)) if self.owner else
                              make_transport(transport, self.mine, self._transport_engines, **transport_kwargs))
        self.transport_name = transport
        self._engine_urls, self._transport_kwargs = list(engine_urls), transport_kwargs
        self.segment_senders = senders == "segment"
        self.owners: SegmentOwners | None = None
        """Who sends each engine rank's segment, when this rank's stage has several senders (set in :meth:`connect`)."""
        self.is_helper = False
        """This rank sends segments of its stage besides the stage sender (several senders per stage)."""
        self._connected = False
        self._owner_order: list | None = None  # owner senders: this stage's buckets in send order (connect)
        self.sliced = False
        """Buckets are laid out per engine rank (decided in :meth:`connect`, the same on every rank)."""
        self._ring: list[torch.Tensor | None] = [None] * RING_SLOTS  # host bucket buffers kept across syncs
        self._wire_ring: list[torch.Tensor | None] = [None] * RING_SLOTS  # quantised buckets (FP8 engines)
        self._gather_cache: dict = {}  # the gatherers' metadata, kept across syncs

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        barrier(group=self.control)

    def _senders(self, plan: WeightSyncPlan | None = None) -> list[int]:
        """The stage senders of ``plan`` (default: this rank's replica), in stage order."""
        plan = plan or self.mine
        if plan is None:
            return []
        return sorted({b.sender_rank for b in plan.buckets},
                      key=lambda r: next(b.pp_rank for b in plan.buckets if b.sender_rank == r))

    def _token(self, send: bool, peer: int, *, failed: bool = False) -> bool:
        """Pass the push turn to / wait for it from ``peer`` (global rank) on the gloo control group;
        the token says whether the stages before failed (``failed``; returned by the receiving side)."""
        token = torch.tensor([1.0 if failed else 0.0])
        (send_tensor if send else recv_tensor)(token, peer, group=self.control)
        return bool(token.item() > 0)

    def connect(self) -> None:
        """Create the transport's groups with the engines, stage by stage (collective; the replicas'
        senders of one stage connect side by side, to disjoint engines)."""
        mine = self._senders()
        for index in range(len(self._senders(self.plan))):
            if index < len(mine) and self.rank == mine[index]:
                required(self.transport, "transport").connect(index)
            self._barrier()
        # Buckets laid out per engine rank (no packing copy) only if every sender's transport takes
        # them: the stage's other ranks send their shards accordingly (transport auto resolves on senders).
        takes = not self.is_sender or (required(self.transport, "transport").sliced_buckets
                                       and self.plan.quantization is None)
        flag = all_reduce(torch.tensor([1.0 if takes else 0.0], dtype=torch.float64), op=dist.ReduceOp.MIN,
                          group=self.control)
        self.sliced = bool(flag.item() > 0)
        if self.owner:
            self._connect_owner_senders()
        elif self.sliced and self.stage is not None:
            self._connect_segment_senders()
        self._connected = True

    def _connect_segment_senders(self) -> None:
        """Buckets laid out per engine rank (``p2p``; every rank of the stage computes the same
        owners from the plan): who sends each segment, in which messages; with several senders
        (``segment_senders``) the stage's helpers get a ``p2p`` transport of their own, and every
        sender learns the others (the group itself is made in the first sync)."""
        mine, stage = required(self.mine, "the replica's plan"), required(self.stage, "the stage")
        owners = SegmentOwners(mine, self.placement, several=self.segment_senders)
        senders = owners.senders(stage)
        self.owners = owners
        if self.rank not in senders:
            return
        index = senders.index(self.rank)
        if index > 0:
            self.is_helper = True
            self._transport_engines = EngineClients([self._engine_urls[i] for i in required(mine.engines, "engines")])
            self.transport = make_transport("p2p", mine, self._transport_engines, **self._transport_kwargs)
            self.transport.connect(self._senders().index(senders[0]))
        transport: Any = required(self.transport, "transport")  # P2PTransport (auto resolved to p2p: sliced)
        transport.set_senders(senders, index, self.control, owners, list(mine.stage_buckets(stage)))

    def _connect_owner_senders(self) -> None:
        """Owner senders: every trainer rank joins the one group of the sync (stage by stage, the
        coordinator first), so all stages deliver at once; who sends which part comes from the
        plan (:class:`~megarl.weight_sync.owners.OwnerParts`)."""
        mine, stage = required(self.mine, "the replica's plan"), required(self.stage, "the stage")
        transport = required(self.transport, "transport")
        assert isinstance(transport, OwnerTransport)  # built so in __init__ with owner senders
        parts = OwnerParts(mine, self.placement)
        senders = parts.group_senders()
        index = senders.index(self.rank)
        self.is_helper = index > 0
        if self.is_helper:
            transport.connect(stage)
        self._owner_order = parts.stage_order(stage)  # round by round (OwnerParts.rounds)
        transport.set_owner_senders(senders, index, self.control, parts, self._owner_order)

    # ------------------------------------------------------------------ the sync
    def sync(self, local_params: Mapping[str, torch.Tensor], policy_version: int, *,
             load_proof: bool | None = None) -> dict[str, float]:
        """Push ``local_params`` (this rank's shards, global names) to every engine (collective).

        See the module docstring for the ordering. Returns the metrics (identical on every rank).
        ``load_proof``: the engines read this sync's ``p2p`` buckets back (``weight_sync.load_proof``,
        :func:`megarl.launch.weight_sync_stage.load_proof_now`); None keeps the transport's setting.

        Raises:
            WeightSyncError: a planned shard is missing or malformed, conversion did not produce the
                planned tensors, or an engine refused an update.
        """
        if self.placement is not None:  # as the family's sync table reads them (gpt-oss: experts in HF layout)
            local_params = self.placement.local_view(local_params)
        if self.mine is not None:
            check_local_params(self.mine, self.rank, local_params)
        if load_proof is not None and hasattr(self.transport, "load_proof"):  # the checked transports
            self.transport.load_proof = load_proof  # type: ignore[union-attr]  # hasattr: not None
        if not self._connected:
            self.connect()
        start = time.perf_counter()
        version = str(policy_version)
        engines, paused_at = self.engines, 0.0
        if engines is not None:  # the coordinator: 1. pause
            engines.call_all("pause", self.pause_mode)
            paused_at = time.perf_counter()
            if required(self.transport, "transport").needs_session:
                engines.call_all("begin_weight_update")
        self._barrier()
        on_cpu = all(t.device.type == "cpu" for t in local_params.values())
        gatherer: OwnerFeed | StageGatherer | None = None
        if self.owner and self.mine is not None and self.stage is not None:  # each rank sends its own parts
            gatherer = OwnerFeed(self.mine, self.stage, local_params, self._owner_order)
        elif self.mine is not None:
            gatherer = StageGatherer(self.mine, self.rank, local_params, self.placement, group=self.group,
                                     ring=self._ring if on_cpu else None, sliced=self.sliced, owners=self.owners,
                                     cache=self._gather_cache)
        try:
            stats, failure = (self._push(gatherer, version) if gatherer is not None else {}), None  # 2. push
        except WeightSyncError as err:  # every rank must learn it (the others finished their part)
            stats, failure = {}, err
        self._raise_if_failed(failure)
        if engines is not None:
            transport = required(self.transport, "transport")
            transport.finish(version)
            if transport.needs_session:
                engines.call_all("end_weight_update")
            self._flush()  # 3. flush
            engines.call_all("update_weight_version", version)  # 4. weight_version
            engines.call_all("resume")  # 5. continue
            stats["engine_paused_s"] = time.perf_counter() - paused_at  # generation stopped this long
            stats["engine_load_s"] = transport.stats.engine_load_s  # includes the disk reload
        stats["weight_sync_s"] = time.perf_counter() - start
        return self._reduce(stats)

    def _raise_if_failed(self, failure: WeightSyncError | None) -> None:
        """Barrier that raises on every rank when ``failure`` is set on any (collective).

        The engines stay paused (and in their update session): a refused bucket was never loaded,
        but earlier buckets may have been; the caller decides (retry the sync, or reload from disk).
        """
        flag = all_reduce(torch.tensor([1.0 if failure is not None else 0.0], dtype=torch.float64),
                          op=dist.ReduceOp.MAX, group=self.group)
        if failure is not None:
            raise failure
        if flag.item() > 0:
            raise WeightSyncError("the weight sync failed on another trainer rank (a stage sender); see its error")

    def _flush(self) -> None:
        from megarl.rollout.client import EngineRequestError

        try:
            # requests may be retracted, in flight
            required(self.engines, "the engines").call_all("flush_cache", paused=True)
        except EngineRequestError as err:
            raise WeightSyncError(
                f"an engine refused to flush its prefix cache after the weight update ({err})"
                + ("; with weight_sync.pause_mode='in_place' requests that keep running hold old-policy KV "
                   "(use retract or abort)" if self.pause_mode == "in_place" else "")) from err

    def verify(self, probes, trainer_logprobs, *, tolerance: float) -> dict[str, float]:
        """Compare the engines' logprobs on ``probes`` with the trainer's (collective; all ranks raise).

        Args:
            probes: token-id sequences (same on every rank).
            trainer_logprobs: per probe, the trainer's ``[P - 1]`` logprobs of tokens 1..P-1
                (e.g. from ``Trainer.compute_logprobs``; same on every rank).
            tolerance: ``weight_sync.verify_tolerance`` (mean absolute difference).

        Raises:
            WeightSyncError: on every rank, when an engine disagrees.
        """
        from megarl.weight_sync.verify import verify_engine_logprobs

        result = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)  # failed, mean, max
        if self.is_coordinator:
            try:
                metrics = verify_engine_logprobs(required(self.engines, "the engines"), probes, trainer_logprobs,
                                                 tolerance=tolerance)
                result[1] = metrics["weight_sync/verify_logprob_diff_mean"]
                result[2] = metrics["weight_sync/verify_logprob_diff_max"]
            except WeightSyncError:
                result[0] = 1.0
        all_reduce(result, group=self.group)  # only the coordinator contributes
        if result[0] > 0:
            raise WeightSyncError(f"engines disagree with the trainer after the weight sync "
                                  f"(mean |logprob diff| > {tolerance:g}); see the coordinator's log")
        return {"weight_sync/verify_logprob_diff_mean": result[1].item(),
                "weight_sync/verify_logprob_diff_max": result[2].item()}

    def _push(self, gatherer: StageGatherer | OwnerFeed, version: str) -> dict[str, float]:
        stats = {"gather_s": 0.0, "convert_s": 0.0, "quantize_s": 0.0, "transfer_s": 0.0, "engine_load_s": 0.0,
                 "bytes_sent": 0.0, "gather_bytes": 0.0}
        if not self.is_sender and not self.is_helper:
            stats["gather_bytes"] = float(gatherer.send_contributions())
            return stats
        transport = required(self.transport, "transport")
        transport.start_sync()
        senders = self._senders()
        index = senders.index(self.rank) if self.is_sender else 0
        ordered = transport.ordered_stages and len(senders) > 1 and self.is_sender  # helpers follow their stage sender
        # Contributions of this stage are gathered while we may still wait for our turn.
        buckets: Iterator[Any] = gatherer.iter_hf_buckets()
        quantizer = None
        if self.plan.quantization is not None and not self.owner:  # block-FP8 engines (owners quantise parts)
            from megarl.weight_sync.quantizer import WireQuantizer

            quantizer = WireQuantizer(self.plan.quantization, self._wire_ring)
            buckets = quantizer.wrap(buckets)
        try:  # gathered while we may still wait for our turn; an error is raised after it came
            first, early = next(buckets, None), None
        except Exception as err:  # noqa: BLE001 - raised below, after the turn
            first, early = None, err
        failed = True
        try:
            if ordered and index > 0 and self._token(False, senders[index - 1]):
                early = early or WeightSyncError(
                    f"trainer rank {self.rank}: an earlier pipeline stage's push failed, so stage {self.stage} "
                    f"sent nothing (that stage's error says why)")
            if early is not None:
                self._release(transport, buckets)
                raise early
            try:
                if first is not None:
                    transport.send(*first)
                    for bucket, tensors, flat in buckets:
                        transport.send(bucket, tensors, flat)
            except BaseException:  # a gather / conversion error mid-stage: release the engines first
                self._release(transport, buckets)
                raise
            transport.drain()
            failed = False
        finally:  # the next stage's sender waits for its turn even when this stage failed
            if ordered and index + 1 < len(senders):
                self._token(True, senders[index + 1], failed=failed)
        stats.update(gather_s=gatherer.timings.gather_s, convert_s=gatherer.timings.convert_s,
                     transfer_s=transport.stats.transfer_s, engine_load_s=transport.stats.engine_load_s,
                     bytes_sent=float(transport.stats.bytes_sent),
                     quantize_s=quantizer.quantize_s if quantizer is not None else 0.0)
        self._rank_bytes = list(transport.stats.engine_rank_bytes)
        return stats

    @staticmethod
    def _release(transport: Transport, buckets) -> None:
        """After this stage's sender failed: release the engines (:meth:`Transport.abort`), then take
        the later buckets the stage's other ranks still send their shards of (errors dropped: the
        first one is raised)."""
        transport.abort()
        with contextlib.suppress(Exception):  # the first error is the one to raise
            for _ in buckets:
                pass

    def _reduce(self, stats: dict[str, float]) -> dict[str, float]:
        """Every rank's metrics reduced over the trainer group (:func:`reduce_sync_stats`)."""
        replica = required(self.mine, "the replica's plan").replica if self.is_sender else None
        if self.owner:  # one group for every stage: each sender saw every engine rank's bytes; count them once
            replica = 0 if self.is_coordinator else None
        return reduce_sync_stats(self.plan, stats, self.group, replica=replica,
                                 rank_bytes=getattr(self, "_rank_bytes", None))

    def close(self) -> None:
        """Destroy the transport's groups and the HTTP sessions."""
        if self.transport is not None:
            self.transport.close()
        for engines in (self.engines, self._transport_engines):
            if engines is not None:
                engines.close()
