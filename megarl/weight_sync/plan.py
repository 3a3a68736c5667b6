"""The weight-sync plan: pure data saying who gathers, converts, buckets and receives what.

``build_plan(trainer_layout, engine_layout, param_specs)`` needs only names, shapes, dtypes and
layouts. For every Megatron parameter it records the pipeline stage and model chunk that hold it
(virtual-pipeline offsets), the trainer ranks holding each of its TP / ETP shards (expert index
offsets over EP), the stage's *sender* that gathers the shards and converts them to HF tensors, and
the bucket the HF tensors travel in (``weight_sync.bucket_size_mb``). For every engine rank it
gives the slice of each HF tensor that rank holds (``engine_slice``), so bytes per engine rank are
an output of the plan for every transport.

Gathering: ``buckets`` are those of replica 0 of each stage (the data-parallel, context-parallel
and expert-data-parallel block of ranks ``TrainerLayout.replica_block`` holding one complete copy of
the stage); each source rank sends, per bucket, one flat buffer of its shards to the sender.
With ``senders_per_stage`` R > 1 (several engines), replica ``k < R`` of every stage runs the same
buckets with every trainer rank shifted by ``k * replica_block`` (:meth:`WeightSyncPlan.for_replica`)
for the engines ``i`` with ``i % R == k``: R senders per stage push in parallel, each over its own
link, to disjoint engines.
Buckets are ordered stage by stage, each stage's first and last ones smaller (:data:`RAMP_STEPS`),
parameters in model order (owner senders: each layer's experts spread, ``spread_experts``); inside a
bucket the HF tensors by decreasing element size, so SGLang's flat bucket never holds a misaligned one.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from megarl.config.sync_transports import TRANSPORTS
from megarl.models.fp8_blocks import BlockFP8
from megarl.plugins import PluginError
from megarl.weight_sync.engine_slices import PlanError, TensorSlice, engine_slices
from megarl.weight_sync.fp8_wire import wire_specs
from megarl.weight_sync.layout import EngineLayout, LayoutError, TrainerLayout, spread_expert_order
from megarl.weight_sync.specs import HFTensorSpec, ParamSpec

MIB = 1 << 20
RAMP_STEPS = 3
"""A stage's first buckets hold at most ``bucket_size / 2**RAMP_STEPS``, then twice as much each,
up to ``bucket_size``; towards its end a bucket holds at most half of the stage's bytes still
left (but at least ``bucket_size / 2**RAMP_STEPS``). Only the first bucket's gather + conversion
comes before any byte moves, and only the last one's transfer + loading after the rest: small
ones fill and drain the pipeline sooner, and the middle keeps the large size's throughput."""


@dataclass(frozen=True)
class ShardSource:
    """Shard ``shard_index`` (along the parameter's ``tp_axis``) held by ``trainer_rank``."""

    trainer_rank: int
    shard_index: int
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ParamTransfer:
    """One Megatron parameter: where its shards are and where it converts."""

    param: ParamSpec
    pp_rank: int
    vp_rank: int
    """Model chunk (virtual pipeline stage) on ``pp_rank``."""
    sources: tuple[ShardSource, ...]
    """Ordered by shard index; concatenating along ``tp_axis`` (per half when gated) gives the tensor."""


@dataclass(frozen=True)
class Bucket:
    """What one sender gathers, converts and sends in one go."""

    index: int
    """Position in the plan (stage-major order)."""
    pp_rank: int
    sender_rank: int
    params: tuple[ParamTransfer, ...]
    hf_tensors: tuple[HFTensorSpec, ...]
    """Wire order (decreasing element size)."""
    wire_tensors: tuple[HFTensorSpec, ...] = ()
    """What the engines receive when it differs from ``hf_tensors`` (block-FP8 served checkpoint:
    FP8 weights and their ``_scale_inv``, wire order; see :mod:`megarl.weight_sync.fp8_wire`)."""

    @property
    def nbytes(self) -> int:
        """HF bytes in the bucket."""
        return sum(t.nbytes for t in self.hf_tensors)

    @property
    def wire(self) -> tuple[HFTensorSpec, ...]:
        """The tensors the engines receive (``wire_tensors``, else ``hf_tensors``)."""
        return self.wire_tensors or self.hf_tensors

    @property
    def wire_nbytes(self) -> int:
        """Bytes the engines receive of this bucket (each engine rank: its slices of them)."""
        return sum(t.nbytes for t in self.wire)

    def gather_bytes(self) -> dict[int, int]:
        """Bytes each non-sender source rank sends to the sender for this bucket."""
        out: dict[int, int] = defaultdict(int)
        for p in self.params:
            for s in p.sources:
                if s.trainer_rank != self.sender_rank:
                    out[s.trainer_rank] += s.nbytes
        return dict(out)

    def contributions(self, trainer_rank: int) -> list[tuple[ParamTransfer, ShardSource]]:
        """The shards ``trainer_rank`` contributes to this bucket, in wire order."""
        return [(p, s) for p in self.params for s in p.sources if s.trainer_rank == trainer_rank]


@dataclass(frozen=True)
class WeightSyncPlan:
    """A complete, executable description of one weight sync (see module docstring)."""

    trainer_layout: TrainerLayout
    engine_layout: EngineLayout
    buckets: tuple[Bucket, ...]
    num_experts: int
    bucket_size_bytes: int
    quantization: BlockFP8 | None = None
    """The served checkpoint's block-FP8 settings: the sender quantises (``Bucket.wire_tensors``)."""
    senders_per_stage: int = 1
    """Replicas of each stage that send, each to its own engines (module docstring)."""
    replica: int = 0
    """Which replica's ranks ``buckets`` name (:meth:`for_replica`)."""
    engines: tuple[int, ...] | None = None
    """Indices of the engines this replica sends to; None = all ``engine_layout.num_engines``."""

    def replica_engines(self, replica: int) -> tuple[int, ...]:
        """The engines replica ``replica`` sends to: ``i`` with ``i % senders_per_stage == replica``."""
        return tuple(range(replica, self.engine_layout.num_engines, self.senders_per_stage))

    def for_replica(self, replica: int) -> WeightSyncPlan:
        """The plan of replica ``replica`` (``0 <= replica < senders_per_stage``): every bucket's
        sender and sources shifted by ``replica * trainer_layout.replica_block`` (ranks holding the
        same shards, :attr:`TrainerLayout.replica_block`), and its engines.

        Raises:
            PlanError: ``replica`` out of range, or called on a replica's plan.
        """
        if self.replica or self.engines is not None:
            raise PlanError("for_replica() takes the whole plan, not a replica's")
        if not 0 <= replica < self.senders_per_stage:
            raise PlanError(f"replica {replica} out of range [0, {self.senders_per_stage})")
        shift = replica * self.trainer_layout.replica_block

        def moved(transfer: ParamTransfer) -> ParamTransfer:
            return replace(transfer, sources=tuple(replace(s, trainer_rank=s.trainer_rank + shift)
                                                   for s in transfer.sources))

        buckets = tuple(replace(b, sender_rank=b.sender_rank + shift, params=tuple(moved(t) for t in b.params))
                        for b in self.buckets)
        return replace(self, buckets=buckets, replica=replica, engines=self.replica_engines(replica))

    def stage_buckets(self, pp_rank: int) -> tuple[Bucket, ...]:
        """The buckets of pipeline stage ``pp_rank``, in send order."""
        return tuple(b for b in self.buckets if b.pp_rank == pp_rank)

    def hf_tensors(self) -> Iterator[HFTensorSpec]:
        """Every HF tensor the plan converts (trainer dtype), bucket by bucket."""
        for b in self.buckets:
            yield from b.hf_tensors

    def wire_tensors(self) -> Iterator[HFTensorSpec]:
        """What the engines receive, bucket by bucket (the served checkpoint's tensors)."""
        for b in self.buckets:
            yield from b.wire

    @property
    def total_bytes(self) -> int:
        """Bytes of all HF tensors of the plan (trainer dtype; see :attr:`wire_bytes` for what is sent)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def wire_bytes(self) -> int:
        """Bytes of :meth:`wire_tensors` (``total_bytes`` unless the engines serve FP8)."""
        return sum(b.wire_nbytes for b in self.buckets)

    def engine_slice(self, tensor: HFTensorSpec, tp_rank: int) -> TensorSlice | None:
        """The part of ``tensor`` that engine rank ``tp_rank`` holds; None = none (a remote expert).

        Raises:
            PlanError: SGLang cannot load this tensor pre-sharded at this engine layout.
        """
        return engine_slices(tensor, self.engine_layout, self.num_experts).get(tp_rank)

    def engine_slices_of(self, tensor: HFTensorSpec) -> dict[int, TensorSlice]:
        """``{engine tp_rank: slice}`` for the ranks of one engine that hold part of ``tensor``."""
        return engine_slices(tensor, self.engine_layout, self.num_experts)

    def engine_shard_bytes(self) -> list[int]:
        """Bytes of served tensor data (:meth:`wire_tensors`) each engine rank (of one engine) holds:
        its shard size."""
        return list(self._engine_shard_bytes)

    @functools.cached_property
    def _engine_shard_bytes(self) -> tuple[int, ...]:
        sizes = [0] * self.engine_layout.tp_size
        for t in self.wire_tensors():
            for rank, sl in engine_slices(t, self.engine_layout, self.num_experts).items():
                sizes[rank] += math.prod(sl.shape(t.shape)) * t.itemsize
        return tuple(sizes)

    def engine_rank_bytes(self, transport: str) -> list[int]:
        """Bytes each engine rank (of one engine) receives per sync with ``transport``.

        A transport whose registry entry ``delivers_shards`` (``shard``, ``p2p``) delivers exactly each
        rank's slices; the others (``distributed`` broadcasts, ``tensor``/``disk`` hand over whole
        tensors) every tensor whole, so every rank receives everything.

        Raises:
            PlanError: ``transport`` is neither a registered transport nor an import path that loads one.
        """
        try:
            entry = TRANSPORTS.resolve(transport)
        except PluginError as e:
            raise PlanError(f"unknown transport {transport!r}: {e.message}") from e
        if entry.delivers_shards:
            return self.engine_shard_bytes()
        return [self.wire_bytes] * self.engine_layout.tp_size


def _locate(param: ParamSpec, layout: TrainerLayout, num_layers: int) -> tuple[int, int]:
    if param.layer is not None:
        pp_rank, vp_rank, _ = layout.layer_location(param.layer, num_layers)
        return pp_rank, vp_rank
    if param.first_stage:
        return 0, 0
    return layout.pp_size - 1, layout.vpp_size - 1


def _sources(param: ParamSpec, layout: TrainerLayout, pp_rank: int, num_experts: int) -> tuple[ShardSource, ...]:
    if param.expert is not None:
        ep_rank, _ = layout.expert_location(param.expert, num_experts)
        num_shards = layout.etp_size if param.tp_axis is not None else 1
        ranks = [layout.expert_rank(etp_rank=k, ep_rank=ep_rank, pp_rank=pp_rank) for k in range(num_shards)]
    else:
        num_shards = layout.tp_size if param.tp_axis is not None else 1
        ranks = [layout.rank(tp_rank=k, pp_rank=pp_rank) for k in range(num_shards)]
    shape = param.shard_shape(num_shards)
    nbytes = param.nbytes // num_shards
    return tuple(ShardSource(r, k, shape, nbytes) for k, r in enumerate(ranks))


def _check_unique(params: Sequence[ParamSpec]) -> None:
    seen: set[str] = set()
    hf_seen: set[str] = set()
    for p in params:
        if p.name in seen:
            raise PlanError(f"duplicate Megatron parameter {p.name!r}")
        seen.add(p.name)
        for t in p.hf:
            if t.name in hf_seen:
                raise PlanError(f"HF tensor {t.name!r} produced twice (second time by {p.name!r})")
            hf_seen.add(t.name)


def _wire_order(params: Sequence[ParamTransfer]) -> tuple[HFTensorSpec, ...]:
    tensors = [t for p in params for t in p.param.hf]
    return tuple(sorted(tensors, key=lambda t: -t.itemsize))  # stable: model order within a size


def build_plan(trainer_layout: TrainerLayout, engine_layout: EngineLayout, param_specs: Sequence[ParamSpec],
               *, bucket_size_mb: float = 512, quantization: BlockFP8 | None = None,
               senders_per_stage: int | None = None, spread_experts: bool = False) -> WeightSyncPlan:
    """Plan one weight sync from metadata alone.

    Args:
        trainer_layout: Megatron parallel sizes of the trainer.
        engine_layout: SGLang engine layout.
        param_specs: every Megatron parameter of the model (global names), in model order.
        bucket_size_mb: bucket size in MiB (HF bytes); a larger single parameter or engine load group
            (``ParamSpec.load_group``, kept whole: a bucket may exceed the size for it) gets its own bucket.
            Each stage's buckets ramp up to it and down at the end (:data:`RAMP_STEPS`).
        quantization: the served checkpoint's block-FP8 settings (``quantization_config``); each
            bucket then carries the FP8 weights and scales the engines receive (``wire_tensors``).
        senders_per_stage: at most this many replicas of each stage send, each to its own engines
            (``weight_sync.senders_per_stage``); None = as many as there are engines and complete
            copies of the stage (``trainer_layout.replicas_per_stage``). 1 = one sender per stage.
        spread_experts: each layer's experts in :func:`~megarl.weight_sync.layout.spread_expert_order`
            (owner senders: a bucket spreads over the EP owners and engine EP ranks, not one or two
            of each; :func:`megarl.weight_sync.senders.plan_rounds`); False: model order.

    Returns:
        The plan.

    Raises:
        PlanError: duplicate parameter or HF names, no parameters, or a bad bucket size.
        LayoutError: layers / experts that do not split over PP*VPP / EP.
        SpecError: a shape that does not split over TP / ETP.
    """
    if not param_specs:
        raise PlanError("param_specs is empty")
    if bucket_size_mb <= 0:
        raise PlanError(f"weight_sync.bucket_size_mb must be > 0, got {bucket_size_mb}")
    senders = _num_senders(trainer_layout, engine_layout, senders_per_stage)
    _check_unique(param_specs)
    layers = [p.layer for p in param_specs if p.layer is not None]
    num_layers = max(layers) + 1 if layers else 0
    experts = [p.expert for p in param_specs if p.expert is not None]
    num_experts = max(experts) + 1 if experts else 0
    if num_experts and num_experts % engine_layout.ep_size:
        raise LayoutError(f"num_experts {num_experts} is not divisible by the engine's expert_parallel_size "
                          f"{engine_layout.ep_size}")
    per_stage: dict[int, list[ParamTransfer]] = defaultdict(list)
    for p in param_specs:
        if not p.hf:  # not exported (a tied output layer): never gathered
            continue
        pp_rank, vp_rank = _locate(p, trainer_layout, num_layers)
        per_stage[pp_rank].append(ParamTransfer(p, pp_rank, vp_rank, _sources(p, trainer_layout, pp_rank, num_experts)))
    limit = int(bucket_size_mb * MIB)
    order = {e: k for k, e in enumerate(spread_expert_order(num_experts, trainer_layout.ep_size,
                                                            engine_layout.ep_size))} if spread_experts else None
    buckets: list[Bucket] = []
    for pp_rank in sorted(per_stage):
        for transfers in _stage_buckets(per_stage[pp_rank], limit, order):
            hf = _wire_order(transfers)
            wire = wire_specs(hf, quantization) if quantization is not None else ()
            buckets.append(Bucket(len(buckets), pp_rank, trainer_layout.sender_rank(pp_rank), tuple(transfers),
                                  hf, wire))
    return WeightSyncPlan(trainer_layout, engine_layout, tuple(buckets), num_experts, limit, quantization, senders)


def _num_senders(trainer_layout: TrainerLayout, engine_layout: EngineLayout, senders_per_stage: int | None) -> int:
    """Replicas of each stage that send: at most ``senders_per_stage`` (None: no limit), the
    complete copies of a stage, and the engines.

    Raises:
        PlanError: ``senders_per_stage`` is not a positive integer or None.
    """
    if senders_per_stage is not None and (not isinstance(senders_per_stage, int) or senders_per_stage < 1):
        raise PlanError(f"weight_sync.senders_per_stage must be a positive integer or null, got {senders_per_stage!r}")
    senders = min(trainer_layout.replicas_per_stage, engine_layout.num_engines)
    return senders if senders_per_stage is None else min(senders, senders_per_stage)


def _load_units(transfers: Sequence[ParamTransfer]) -> list[list[ParamTransfer]]:
    """``transfers`` in model order, the members of each engine load group (``ParamSpec.load_group``)
    together at the place of its first member: the units a bucket boundary may not cut."""
    units: list[list[ParamTransfer]] = []
    by_group: dict[str, list[ParamTransfer]] = {}
    for t in transfers:
        key = t.param.load_group
        if key is None:
            units.append([t])
        elif key in by_group:
            by_group[key].append(t)
        else:
            by_group[key] = [t]
            units.append(by_group[key])
    return units


def _spread(units: list[list[ParamTransfer]], order: dict) -> list[list[ParamTransfer]]:
    """``units``, each run of one layer's expert units sorted by ``order[expert]`` (stable: an expert's
    units stay in model order, together); every other unit keeps its place."""
    out: list[list[ParamTransfer]] = []
    run: list[list[ParamTransfer]] = []  # the current layer's expert units
    for unit in units:
        p = unit[0].param
        movable = p.expert is not None and all(t.param.expert == p.expert for t in unit)
        if not (movable and run and p.layer == run[0][0].param.layer):
            out.extend(sorted(run, key=lambda u: order[u[0].param.expert]))
            run = []
        (run if movable else out).append(unit)
    return out + sorted(run, key=lambda u: order[u[0].param.expert])


def _stage_buckets(transfers: Sequence[ParamTransfer], limit: int, order: dict | None) -> list[list[ParamTransfer]]:
    """One stage's parameters cut into buckets of at most ``limit`` HF bytes, ramping up from
    ``limit / 2**RAMP_STEPS`` and down towards the stage's end (:data:`RAMP_STEPS`); with ``order``
    (``build_plan``'s ``spread_experts``) each layer's experts in that order (:func:`_spread`).

    A boundary never falls inside an engine load group (``ParamSpec.load_group``: tensors the
    engine's SGLang loader must see in one ``load_weights`` call, ``Family.engine_load_groups``):
    the group's members travel together, after the parameters that precede its first member, so a
    bucket may exceed its cap by what keeps a group whole. A parameter or group larger than its
    bucket's cap gets a bucket of its own."""
    out: list[list[ParamTransfer]] = []
    current: list[ParamTransfer] = []
    current_bytes = 0
    left = sum(h.nbytes for t in transfers for h in t.param.hf)  # not yet in a closed bucket
    units = _load_units(transfers)
    for unit in _spread(units, order) if order is not None else units:
        size = sum(h.nbytes for t in unit for h in t.param.hf)
        cap = min(limit >> max(RAMP_STEPS - len(out), 0),  # up: 1/8, 1/4, 1/2, 1
                  max(limit >> RAMP_STEPS, left // 2))  # down: at most half of what is left
        if current and current_bytes + size > cap:
            out.append(current)
            left -= current_bytes
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += size
    if current:
        out.append(current)
    return out
