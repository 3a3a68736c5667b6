"""What a run or an evaluation reserves: the placement groups' bundles, computed from the config alone
(:func:`bundle_shapes`; :func:`megarl.cluster.placement.build_placement` creates them).

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
    """The bundles to reserve.

    Attributes:
        trainer: the trainer group's bundles, one per device (``{"CPU": 1, "GPU": 1}`` on CUDA); the
            colocated engines sit in them. Empty when nothing runs there (evaluation, disaggregated).
        rollout: the disaggregated engines' bundles, one per engine node part (``{"CPU": 1, "GPU":
            devices per part}`` on CUDA); empty when colocated or without engines to start.
        colocated: ``cluster.placement == "colocated"``.
    """

    trainer: list[dict]
    rollout: list[dict]
    colocated: bool

    def gpus(self) -> float:
        """GPUs reserved in all (0 on CPU)."""
        return float(sum(b.get("GPU", 0) for b in [*self.trainer, *self.rollout]))


def bundle_shapes(cfg: MegarlConfig, *, roles: bool, engines_only: bool = False) -> BundleShapes:
    """The bundles a run (``engines_only=False``) or an evaluation (True) reserves.

    Args:
        cfg: the run's config (``cluster``, ``rollout``).
        roles: the cluster advertises ``megarl_trainer`` / ``megarl_rollout`` per node (Slurm jobs):
            bundles ask for them, pinning trainer ranks and engines to their nodes.
        engines_only: only the engines run (evaluation): see the module docstring.
    """
    cuda = use_cuda(cfg.cluster.device)
    colocated = cfg.cluster.placement == "colocated"
    per_engine = devices_per_engine(cfg.rollout)
    num_engines = 0 if cfg.rollout.external_engine_urls else int(cfg.rollout.num_engines)
    world = trainer_world_size(cfg.cluster)
    trainer_bundle = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
    if roles:
        trainer_bundle["megarl_trainer"] = 1
    if engines_only:
        world = min(world, num_engines * per_engine) if colocated else 0
    trainer = [dict(trainer_bundle) for _ in range(world)]
    if colocated:
        return BundleShapes(trainer, [], True)
    parts = engine_nodes(cfg.cluster, cfg.rollout)
    per_part = per_engine // parts  # a whole node's devices when an engine spans nodes
    engine_bundle = {"CPU": 1, "GPU": per_part} if cuda else {"CPU": 1}
    if roles:
        engine_bundle["megarl_rollout"] = per_part
    return BundleShapes(trainer, [dict(engine_bundle) for _ in range(num_engines * parts)], False)
