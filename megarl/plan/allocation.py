"""A run's Slurm allocation: the nodes it holds, the ``sbatch`` line that asks for them, and what fits
in a smaller allocation.

A run holds ``cluster.trainer_nodes`` nodes for the trainer and, with ``cluster.placement:
disaggregated``, ``cluster.rollout_nodes`` more for its engines (colocated engines share the trainer's
nodes; external engines, ``rollout.external_engine_urls``, hold none). Engines never straddle nodes:
``rollout_devices_per_node // engine TP`` of them share a node, and an engine larger than a node
spans ``engine TP / rollout_devices_per_node`` whole nodes (SGLang's ``--nnodes``). The trainer's
nodes are fixed by its parallel layout (``parallel.*`` sizes its world); only the rollout side
shrinks here, by running fewer engines.
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

SBATCH_SCRIPT = "slurm/train.sbatch"
"""The job script that starts Ray on the allocation and runs ``megarl train`` (its header)."""


@dataclass(frozen=True)
class RunNodes:
    """Nodes a run holds: ``trainer`` + ``rollout`` (0 when colocated or external)."""

    trainer: int
    rollout: int

    @property
    def nodes(self) -> int:
        """All the run's nodes."""
        return self.trainer + self.rollout


def run_nodes(cfg) -> RunNodes:
    """The nodes the run's ``cluster`` section asks for (module docstring)."""
    cl = cfg.cluster
    own_rollout = cl.placement == "disaggregated" and not cfg.rollout.external_engine_urls
    return RunNodes(int(cl.trainer_nodes), int(cl.rollout_nodes) if own_rollout else 0)


def engines_on(nodes: int, engine_tp: int, devices_per_node: int) -> int:
    """How many engines of ``engine_tp`` devices fit on ``nodes`` rollout nodes of ``devices_per_node``
    devices (whole engines per node; an engine larger than a node takes whole nodes; 0 when an engine
    would span a partial node)."""
    if engine_tp < 1 or devices_per_node < 1 or nodes < 1:
        return 0
    if engine_tp <= devices_per_node:
        return nodes * (devices_per_node // engine_tp)
    if engine_tp % devices_per_node:
        return 0
    return nodes // (engine_tp // devices_per_node)


def sbatch_command(recipe: str, overrides: Sequence[str], nodes: int, gpus_per_node: int) -> str:
    """The ``sbatch`` line that runs ``recipe`` with ``overrides`` on ``nodes`` nodes of
    ``gpus_per_node`` GPUs (each argument shell-quoted)."""
    words = ["sbatch", f"--nodes={nodes}", f"--gpus-per-node={gpus_per_node}", SBATCH_SCRIPT, recipe, *overrides]
    return shlex.join(words)


def smaller_allocation(cfg, alloc_nodes: int) -> str:
    """What of the run fits on ``alloc_nodes`` nodes, when fewer than :func:`run_nodes` asks for:
    the rollout split that keeps the trainer's nodes and runs the most engines that fit on the rest
    (overrides to paste back), or that nothing does and the fewest nodes this trainer layout runs on.
    """
    cl, r = cfg.cluster, cfg.rollout
    need = run_nodes(cfg)
    trainer = (f"the trainer alone holds cluster.trainer_nodes={need.trainer} nodes (its layout: parallel.* "
               "sizes its world; megarl plan --suggest names the fewest nodes a trainer layout fits)")
    if need.rollout == 0:
        return f"nothing fits in {alloc_nodes} node(s): {trainer}"
    tp, per_node = int(r.engine.tensor_parallel_size), int(cl.rollout_devices_per_node)
    one_engine = max(1, -(-tp // max(per_node, 1)))
    rollout = alloc_nodes - need.trainer
    engines = min(engines_on(rollout, tp, per_node), int(r.num_engines))
    if engines < 1:
        return (f"nothing fits in {alloc_nodes} node(s): {trainer}, and one engine of TP {tp} needs "
                f"{one_engine} more (cluster.rollout_devices_per_node={per_node}); the fewest nodes this "
                f"recipe runs on are {need.trainer + one_engine}, with cluster.rollout_nodes={one_engine} "
                f"rollout.num_engines={engines_on(one_engine, tp, per_node)}")
    return (f"fits in {alloc_nodes} node(s) with fewer engines ({engines} of {r.num_engines}, TP {tp}): "
            f"cluster.rollout_nodes={rollout} rollout.num_engines={engines}")
