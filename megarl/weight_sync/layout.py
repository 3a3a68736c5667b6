"""Trainer and engine parallel layouts as small values: who holds which shard of which tensor.

Trainer ranks follow Megatron-Core's rank order ``tp-cp-ep-dp-pp`` (``initialize_model_parallel``'s
default): dense parameters live on the grid ``tp x cp x dp x pp`` and expert parameters on the grid
``etp x ep x edp x pp``, both with ``tp`` (resp. ``etp``) fastest and ``pp`` slowest::

    rank        = tp_rank  + tp  * (cp_rank + cp * (dp_rank  + dp  * pp_rank))
    expert rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

so the ranks of pipeline stage ``s`` are ``[s * W/pp, (s + 1) * W/pp)`` in both grids, and the rank
with every coordinate 0 in stage ``s`` (``s * W/pp``) holds shard 0 of everything the stage holds:
it is the stage's *sender*.

Engine ranks follow SGLang 0.5.23 (``distributed/parallel_state.py``, moe data-parallel size 1):
inside one engine of TP size ``T`` with expert-parallel size ``ep``, ``moe_tp_size = T / ep``,
``moe_tp_rank = tp_rank % moe_tp_size`` and ``moe_ep_rank = tp_rank // moe_tp_size``; expert
parallel rank ``e`` holds the ``E / ep`` contiguous global experts starting at ``e * E / ep``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """A layout that cannot hold the model (sizes that do not divide, ranks out of range)."""


def _check_positive(owner: str, **sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise LayoutError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """Megatron-Core parallel sizes of the trainer (field names as in ``ParallelConfig``)."""

    tensor_model_parallel_size: int = 1
    """TP: dense weights are split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: decoder layers are split into this many stages."""
    expert_model_parallel_size: int = 1
    """EP: experts are split over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """ETP: each expert is split over this many ranks; None = Megatron's default (TP)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per PP stage (interleaved schedule); None = 1."""
    context_parallel_size: int = 1
    """CP: sequence split; replicates weights."""
    data_parallel_size: int = 1
    """DP: replicas of the dense weights (world = TP * CP * DP * PP)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Uneven pipeline: decoder layers on the first stage (Megatron's field); None = even split."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Uneven pipeline: decoder layers on the last stage (Megatron's field); None = even split."""

    def __post_init__(self) -> None:
        _check_positive(
            "TrainerLayout", tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size, data_parallel_size=self.data_parallel_size)
        per_stage = self.world_size // self.pipeline_model_parallel_size
        expert_grid = self.etp_size * self.expert_model_parallel_size
        if per_stage % expert_grid:
            raise LayoutError(
                f"TrainerLayout: expert_tensor_parallel_size * expert_model_parallel_size = {expert_grid} "
                f"does not divide the ranks per pipeline stage ({per_stage} = TP*CP*DP)")

    @classmethod
    def from_world_size(cls, world_size: int, **sizes: Any) -> TrainerLayout:
        """The layout whose data-parallel size fills ``world_size`` ranks; ``sizes`` are the other fields
        by name (``int``, or ``None`` where the field allows it).

        Raises:
            LayoutError: ``world_size`` is not a multiple of TP * CP * PP.
        """
        model = (sizes.get("tensor_model_parallel_size") or 1) * (sizes.get("context_parallel_size") or 1) \
            * (sizes.get("pipeline_model_parallel_size") or 1)
        if world_size % model:
            raise LayoutError(f"world_size {world_size} is not a multiple of TP*CP*PP = {model}")
        return cls(data_parallel_size=world_size // model, **sizes)

    @property
    def tp_size(self) -> int:
        """``tensor_model_parallel_size``."""
        return self.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        """``pipeline_model_parallel_size``."""
        return self.pipeline_model_parallel_size

    @property
    def ep_size(self) -> int:
        """``expert_model_parallel_size``."""
        return self.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        """``expert_tensor_parallel_size``, defaulting to the dense TP size as in Megatron-Core."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def vpp_size(self) -> int:
        """Virtual pipeline stages per rank (1 without interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        """Trainer ranks: ``tp * cp * dp * pp``."""
        return self.tp_size * self.context_parallel_size * self.data_parallel_size * self.pp_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert shard: ``world_size / (etp * ep * pp)``."""
        return self.world_size // (self.etp_size * self.ep_size * self.pp_size)

    def rank(self, *, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        """Global rank of a dense-grid coordinate (Megatron order ``tp-cp-dp-pp``)."""
        return tp_rank + self.tp_size * (cp_rank + self.context_parallel_size * (
            dp_rank + self.data_parallel_size * pp_rank))

    def expert_rank(self, *, etp_rank: int = 0, ep_rank: int = 0, edp_rank: int = 0, pp_rank: int = 0) -> int:
        """Global rank of an expert-grid coordinate (Megatron order ``tp-ep-dp-pp``, tp = ETP)."""
        return etp_rank + self.etp_size * (ep_rank + self.ep_size * (
            edp_rank + self.expert_data_parallel_size * pp_rank))

    def sender_rank(self, pp_rank: int) -> int:
        """The rank that gathers and sends everything pipeline stage ``pp_rank`` holds."""
        return self.rank(pp_rank=pp_rank)

    @property
    def replica_block(self) -> int:
        """Ranks of one complete copy of a stage's weights: ``lcm(TP, ETP * EP)`` consecutive ranks.

        In Megatron's order the dense weights of a stage repeat every ``TP`` ranks (over CP and DP)
        and its experts every ``ETP * EP`` ranks (over expert DP), so the block of ranks
        ``[base + k * B, base + (k + 1) * B)`` of stage ``s`` (``base = s * W/PP``) holds every
        shard of the stage, and the blocks are disjoint: block ``k``'s rank ``base + k * B + j``
        holds what rank ``base + j`` holds.
        """
        return math.lcm(self.tp_size, self.etp_size * self.ep_size)

    @property
    def replicas_per_stage(self) -> int:
        """Disjoint complete copies of each stage's weights (:attr:`replica_block`)."""
        return self.world_size // self.pp_size // self.replica_block

    def replica_of(self, rank: int) -> int:
        """Which copy (:attr:`replica_block`) of its stage global rank ``rank`` belongs to."""
        return (rank % (self.world_size // self.pp_size)) // self.replica_block

    def stage_ranks(self, pp_rank: int) -> range:
        """All global ranks of pipeline stage ``pp_rank`` (Megatron's rank order ``tp-cp-ep-dp-pp``: a
        stage's ranks are consecutive)."""
        per_stage = self.world_size // self.pp_size
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)

    def _chunk_sizes(self, num_layers: int) -> list[tuple[int, int, int]]:
        """``(pp_rank, vp_rank, num_layers)`` of every model chunk, in layer order.

        Chunks are ordered virtual-stage-major (``vp`` outer, ``pp`` inner), as in Megatron's
        ``get_transformer_layer_offset``; uneven first/last stages split their layers evenly over
        their model chunks, the middle stages share the rest.
        """
        pp, vp = self.pp_size, self.vpp_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if pp == 1 and (first is not None or last is not None):
            raise LayoutError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        per_stage = {}
        for pp_rank in range(pp):
            if pp_rank == 0 and first is not None:
                per_stage[pp_rank] = first
            elif pp_rank == pp - 1 and last is not None:
                per_stage[pp_rank] = last
            else:
                if middle_stages <= 0 or middle_layers % middle_stages:
                    raise LayoutError(
                        f"num_layers {num_layers} minus first/last stage layers ({first}, {last}) does not "
                        f"split evenly over {max(middle_stages, 0)} middle pipeline stages")
                per_stage[pp_rank] = middle_layers // middle_stages
        for pp_rank, count in per_stage.items():
            if count < 0 or count % vp:
                raise LayoutError(
                    f"pipeline stage {pp_rank} would hold {count} layers, not divisible by "
                    f"virtual_pipeline_model_parallel_size {vp} (num_layers {num_layers})")
        return [(pp_rank, vp_rank, per_stage[pp_rank] // vp) for vp_rank in range(vp) for pp_rank in range(pp)]

    def layer_location(self, layer: int, num_layers: int) -> tuple[int, int, int]:
        """Where decoder layer ``layer`` (global, 0-based) lives: ``(pp_rank, vp_rank, local_index)``.

        Raises:
            LayoutError: ``num_layers`` does not split over the stages, or ``layer`` is out of range.
        """
        if not 0 <= layer < num_layers:
            raise LayoutError(f"layer {layer} out of range [0, {num_layers})")
        offset = 0
        for pp_rank, vp_rank, count in self._chunk_sizes(num_layers):
            if layer < offset + count:
                return pp_rank, vp_rank, layer - offset
            offset += count
        raise AssertionError("unreachable: chunk sizes cover num_layers")

    def expert_location(self, expert: int, num_experts: int) -> tuple[int, int]:
        """Where global expert ``expert`` lives: ``(ep_rank, local_index)``.

        Raises:
            LayoutError: ``num_experts`` is not divisible by EP, or ``expert`` is out of range.
        """
        if num_experts % self.ep_size:
            raise LayoutError(
                f"num_experts {num_experts} is not divisible by expert_model_parallel_size {self.ep_size}")
        if not 0 <= expert < num_experts:
            raise LayoutError(f"expert {expert} out of range [0, {num_experts})")
        per_rank = num_experts // self.ep_size
        return expert // per_rank, expert % per_rank


@dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """SGLang engine layout: ``num_engines`` identical servers of TP ``tensor_parallel_size``."""

    tensor_parallel_size: int = 1
    """SGLang ``--tp``: ranks per engine."""
    expert_parallel_size: int = 1
    """SGLang ``--ep-size`` (must divide ``tensor_parallel_size``)."""
    num_engines: int = 1
    """Engines that all receive every weight update."""
    device: str = "cuda"
    """Where the engines run, ``cuda`` or ``cpu`` (SGLang's ``--device``): on ``cpu`` SGLang 0.5.23 pads
    MLP intermediate sizes to a multiple of ``T * 32`` before building the model, which moves the
    engine ranks' slices (:func:`~megarl.weight_sync.engine_slices.sglang_cpu_padded`)."""

    def __post_init__(self) -> None:
        _check_positive("EngineLayout", tensor_parallel_size=self.tensor_parallel_size,
                        expert_parallel_size=self.expert_parallel_size, num_engines=self.num_engines)
        if self.device not in ("cuda", "cpu"):
            raise LayoutError(f"EngineLayout.device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.tensor_parallel_size % self.expert_parallel_size:
            raise LayoutError(
                f"EngineLayout.expert_parallel_size {self.expert_parallel_size} must divide "
                f"tensor_parallel_size {self.tensor_parallel_size}")

    @property
    def tp_size(self) -> int:
        """``tensor_parallel_size``: ranks per engine."""
        return self.tensor_parallel_size

    @property
    def ep_size(self) -> int:
        """``expert_parallel_size``."""
        return self.expert_parallel_size

    @functools.cached_property
    def moe_tp_size(self) -> int:
        """TP size within an expert (SGLang's ``moe_tp_size``): ``tp_size / ep_size``."""
        return self.tensor_parallel_size // self.expert_parallel_size


def spread_expert_order(num_experts: int, trainer_ep_size: int, engine_ep_size: int) -> list[int]:
    """A layer's experts in an order whose every window of consecutive ones spreads over the trainer's
    EP ranks (their owners) and the engine's EP ranks alike (owner senders' buckets,
    :func:`megarl.weight_sync.plan.build_plan`'s ``spread_experts``).

    Both sides hold contiguous blocks of experts: ``b_t = E / trainer_ep_size`` per trainer EP rank,
    ``b_e = E / engine_ep_size`` per engine EP rank. With ``s = min(b_t, b_e)`` dividing
    ``l = max(b_t, b_e)`` the blocks of ``s`` nest in those of ``l``, and expert ``e`` sorts by
    ``(e % s, (e // s) % (l / s), e // l)``: consecutive experts walk through the ``E / l`` large
    blocks first, then through the small blocks inside them, so ``E / l`` consecutive experts sit in
    as many different blocks of either side and ``E / s`` in every small block once (DeepSeek-V3's
    recipe, 256 experts over trainer EP128 and engine EP8: experts 0, 32, 64, ..., 224, then 2, 34,
    ...: eight engine EP ranks and eight owners, then eight more owners). Sizes that do not nest:
    ``(e % b_t, e // b_t)`` (owner after owner). Returns a permutation of ``range(num_experts)``.

    Raises:
        LayoutError: ``num_experts`` not divisible by either EP size.
    """
    if num_experts % trainer_ep_size or num_experts % engine_ep_size:
        raise LayoutError(f"num_experts {num_experts} is not divisible by the trainer's EP {trainer_ep_size} "
                          f"and the engine's EP {engine_ep_size}")
    owner, engine = num_experts // trainer_ep_size, num_experts // engine_ep_size
    small, large = sorted((owner, engine))
    if large % small:
        return sorted(range(num_experts), key=lambda e: (e % owner, e // owner))
    return sorted(range(num_experts), key=lambda e: (e % small, e // small % (large // small), e // large))
