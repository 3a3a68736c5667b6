"""What a run or an evaluation reserves: the placement groups' bundles and the device facts they follow
from, resolved from the config once at start-up (:func:`bundle_shapes`). Ray's start
(:func:`megarl.cluster.placement.init_ray`) and the placement
(:func:`megarl.cluster.placement.build_placement`) take them from here, and the engines and trainer
ranks from the :class:`~megarl.cluster.placement.Placement` made of them, instead of each asking the
config (and ``cluster.device``) again.

Training reserves one bundle per trainer rank and, disaggregated, one per engine node part.
Evaluation (``megarl eval``, ``engines_only``) runs no trainer rank: disaggregated, it reserves the
engines' bundles only; colocated, the engines' devices only (engine ``i``'s bundles
``i * devices_per_engine ...``, as in training), not the whole trainer group.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.config.device import use_cuda
from megarl.config.parallel import trainer_world_size
from megarl.config.schema import MegarlConfig


def devices_per_engine(rollout: Any) -> int:
    """Devices (GPUs; CPU: ranks) one SGLang engine uses: its TP size times its EP size over TP."""
    tp, ep = int(rollout.engine.tensor_parallel_size), int(rollout.engine.expert_parallel_size)
    return max(tp, ep)


def engine_nodes(cluster: Any, rollout: Any) -> int:
    """Nodes one engine spans: 1 when its devices fit a node, else devices / devices per node.

    Only disaggregated engines span nodes (``megarl validate`` refuses the rest, and a devices
    count that is not a whole multiple of ``cluster.rollout_devices_per_node``).
    """
    per_engine, per_node = devices_per_engine(rollout), int(cluster.rollout_devices_per_node)
    if cluster.placement != "disaggregated" or per_engine <= per_node:
        return 1
    return per_engine // per_node


@dataclasses.dataclass(frozen=True)
class BundleShapes:
    """The bundles to reserve, and the facts they follow from.

    Attributes:
        trainer: the trainer group's bundles, one per device (``{"CPU": 1, "GPU": 1}`` on CUDA); the
            colocated engines sit in them. Empty when nothing runs there (evaluation, disaggregated).
        rollout: the disaggregated engines' bundles, one per engine node part (``{"CPU": 1, "GPU":
            devices per part}`` on CUDA); empty when colocated or without engines to start.
        colocated: ``cluster.placement == "colocated"``.
        cuda: ``cluster.device`` resolved in this process (:func:`megarl.config.device.use_cuda`).
        num_engines: the engines megarl starts (0 with ``rollout.external_engine_urls``).
        devices_per_engine: :func:`devices_per_engine`.
        engine_nodes: :func:`engine_nodes`.
        engines_only: reserved for an evaluation (no trainer rank runs).
        Role resources (Slurm) are not in the bundles: :func:`megarl.cluster.placement.with_roles` adds them.
    """

    trainer: list[dict]
    rollout: list[dict]
    colocated: bool
    cuda: bool
    num_engines: int
    devices_per_engine: int
    engine_nodes: int
    engines_only: bool = False

    def gpus(self) -> float:
        """GPUs reserved in all (0 on CPU)."""
        return float(sum(b.get("GPU", 0) for b in [*self.trainer, *self.rollout]))


def bundle_shapes(cfg: MegarlConfig, *, engines_only: bool = False) -> BundleShapes:
    """The bundles a run (``engines_only=False``) or an evaluation (True) reserves.

    Args:
        cfg: the run's config (``cluster``, ``rollout``).
        engines_only: only the engines run (evaluation): see the module docstring.
    """
    colocated = cfg.cluster.placement == "colocated"
    per_engine = devices_per_engine(cfg.rollout)
    parts = engine_nodes(cfg.cluster, cfg.rollout)
    num_engines = 0 if cfg.rollout.external_engine_urls else int(cfg.rollout.num_engines)
    world = trainer_world_size(cfg.cluster)
    cuda = use_cuda(cfg.cluster.device)
    if engines_only:
        world = min(world, num_engines * per_engine) if colocated else 0
    trainer = [{"CPU": 1, "GPU": 1} if cuda else {"CPU": 1} for _ in range(world)]
    per_part = per_engine // parts  # a whole node's devices when an engine spans nodes
    rollout = [] if colocated else [{"CPU": 1, "GPU": per_part} if cuda else {"CPU": 1}
                                    for _ in range(num_engines * parts)]
    return BundleShapes(trainer, rollout, colocated, cuda, num_engines, per_engine, parts, engines_only)
