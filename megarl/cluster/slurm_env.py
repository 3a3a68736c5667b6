"""Slurm allocation -> megarl run: check a config against the allocation and plan each node's role.

The commands that ``slurm/train.sbatch`` and ``slurm/engines.sbatch`` run (``check``, ``wait-nodes``,
``serve-engines``) are in :mod:`megarl.launch.slurm`; this module is what they compute with.

The allocation comes from environment variables that the sbatch script fills from Slurm's (a user
can set them by hand to check a config for a future allocation, without Slurm):

- ``MEGARL_ALLOC_NODES``: number of nodes (also read by :func:`megarl.config.validate.validate`).
- ``MEGARL_ALLOC_GPUS_PER_NODE``: GPUs on every node, set only when the job has GPUs (also read by
  ``validate``); per-node counts for heterogeneous jobs go in ``MEGARL_ALLOC_NODE_GPUS``.
- ``MEGARL_ALLOC_HOSTS``: the node names in allocation order (``scontrol show hostnames``).
- ``MEGARL_ALLOC_NODE_CPUS`` / ``MEGARL_ALLOC_NODE_GPUS``: per-node counts, Slurm's compressed
  syntax accepted (``4(x2),8`` = 4, 4, 8).
- ``MEGARL_ALLOC_HET_GROUPS``: heterogeneous jobs only, the het-job component of each node
  (``0 0 1``): component 0 holds the trainer nodes, component 1 the rollout nodes.

Ray resource convention (the driver places actors with these; documented in slurm/README.md):
every node ``i`` (allocation order, 0 = head, where the driver runs) advertises
``megarl_node_<i>: 1``; node 0 also ``megarl_head: 1``; trainer nodes advertise
``megarl_trainer: cluster.trainer_devices_per_node`` and rollout nodes
``megarl_rollout: cluster.rollout_devices_per_node`` (colocated: both). A trainer rank asks for
``{"megarl_trainer": 1}``, an engine spanning ``k`` devices for ``{"megarl_rollout": k}``.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def expand_counts(text: str) -> list[int]:
    """Expand Slurm's compressed per-node counts: ``"4(x2),8"`` -> ``[4, 4, 8]``.

    Raises:
        ValueError: a part is neither ``N`` nor ``N(xK)``.
    """
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"not a Slurm per-node count list: {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


@dataclass(frozen=True)
class Allocation:
    """The nodes of a Slurm job, in allocation order (the first one runs the batch script)."""

    hosts: tuple[str, ...]
    """Node names."""
    cpus: tuple[int, ...]
    """CPUs per node (0 = unknown; Ray then detects them)."""
    gpus: tuple[int, ...]
    """GPUs per node (0 = none)."""
    het_groups: tuple[int, ...] | None = None
    """Het-job component of each node (0 = trainer side, 1 = rollout side); None = one component."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Allocation:
        """Read the ``MEGARL_ALLOC_*`` variables (see the module docstring).

        Raises:
            ValueError: a variable is malformed or the per-node lists disagree in length.
        """
        hosts = tuple(env.get("MEGARL_ALLOC_HOSTS", "").replace(",", " ").split())
        num_nodes = int(env.get("MEGARL_ALLOC_NODES") or len(hosts) or 0)
        if not num_nodes:
            raise ValueError("MEGARL_ALLOC_NODES (or MEGARL_ALLOC_HOSTS) is not set")
        hosts = hosts or tuple(f"node{i}" for i in range(num_nodes))

        def per_node(name: str, fallback: str) -> tuple[int, ...]:
            counts = expand_counts(env.get(name) or fallback)
            if len(counts) == 1:
                counts *= num_nodes
            if len(counts) != num_nodes:
                raise ValueError(f"{name}={env.get(name)!r} lists {len(counts)} nodes, the job has {num_nodes}")
            return tuple(counts)

        groups = env.get("MEGARL_ALLOC_HET_GROUPS", "").split()
        if len(hosts) != num_nodes:
            raise ValueError(f"MEGARL_ALLOC_HOSTS names {len(hosts)} nodes but MEGARL_ALLOC_NODES={num_nodes}")
        if groups and len(groups) != num_nodes:
            raise ValueError(f"MEGARL_ALLOC_HET_GROUPS lists {len(groups)} nodes, the job has {num_nodes}")
        return cls(hosts=hosts, cpus=per_node("MEGARL_ALLOC_NODE_CPUS", "0"),
                   gpus=per_node("MEGARL_ALLOC_NODE_GPUS", env.get("MEGARL_ALLOC_GPUS_PER_NODE") or "0"),
                   het_groups=tuple(int(g) for g in groups) if groups else None)


@dataclass(frozen=True)
class NodePlan:
    """What one node runs: its Ray resources and the role the driver gives it."""

    index: int
    host: str
    het_group: int
    role: str
    """``trainer``, ``rollout``, ``trainer+rollout`` (colocated) or ``unused``."""
    num_cpus: int
    num_gpus: int
    """GPUs Ray advertises; -1 = let Ray detect them (CUDA runs)."""
    resources: dict

    def line(self) -> str:
        """One whitespace-separated line for the sbatch script (the JSON has no spaces)."""
        res = json.dumps(self.resources, separators=(",", ":"), sort_keys=True)
        return f"{self.index} {self.host} {self.het_group} {self.role} {self.num_cpus} {self.num_gpus} {res}"


def _uses_cpu(cfg, alloc: Allocation) -> bool:
    return cfg.cluster.device == "cpu" or (cfg.cluster.device == "auto" and not any(alloc.gpus))


def _role_indices(cfg, alloc: Allocation) -> tuple[list[int], list[int]]:
    """Node indices (allocation order) of the trainer side and of the rollout side."""
    cl = cfg.cluster
    n_rollout = 0 if cfg.rollout.external_engine_urls else cl.rollout_nodes
    if alloc.het_groups is not None:
        trainer_side = [i for i, g in enumerate(alloc.het_groups) if g == 0]
        rollout_side = [i for i, g in enumerate(alloc.het_groups) if g != 0]
        return trainer_side[: cl.trainer_nodes], rollout_side[:n_rollout]
    everyone = list(range(len(alloc.hosts)))
    if cl.placement == "colocated":
        return everyone[: cl.trainer_nodes], everyone[:n_rollout]
    return everyone[: cl.trainer_nodes], everyone[cl.trainer_nodes: cl.trainer_nodes + n_rollout]


def allocation_issues(cfg, alloc: Allocation) -> list:
    """Checks of ``cluster.*`` against the allocation that :func:`megarl.config.validate.validate` lacks.

    ``validate`` already compares trainer_nodes + rollout_nodes with ``MEGARL_ALLOC_NODES`` and the
    devices per node with ``MEGARL_ALLOC_GPUS_PER_NODE``; this adds het-job components, GPU counts per
    side, external engines (which need only trainer nodes) and CUDA runs on GPU-less allocations.

    Returns:
        A list of :class:`megarl.config.ConfigIssue`, empty when the config fits.
    """
    from megarl.config import ConfigIssue

    cl, issues = cfg.cluster, []
    trainer, rollout = _role_indices(cfg, alloc)
    n_rollout = 0 if cfg.rollout.external_engine_urls else cl.rollout_nodes
    where = "het-job component 0" if alloc.het_groups is not None else "the allocation"
    if len(trainer) < cl.trainer_nodes:
        issues.append(ConfigIssue("cluster.trainer_nodes", f"{where} has only {len(trainer)} node(s) for the "
                                  f"trainer ({' '.join(alloc.hosts)})", cl.trainer_nodes))
    if len(rollout) < n_rollout:
        where = "het-job component 1" if alloc.het_groups is not None else "the allocation"
        issues.append(ConfigIssue("cluster.rollout_nodes", f"{where} has only {len(rollout)} node(s) left for "
                                  f"rollout after {cl.trainer_nodes} trainer node(s)", cl.rollout_nodes))
    if _uses_cpu(cfg, alloc):
        return issues
    for side, key in ((trainer, "cluster.trainer_devices_per_node"), (rollout, "cluster.rollout_devices_per_node")):
        want = cl[key.split(".")[1]]
        short = [f"{alloc.hosts[i]}:{alloc.gpus[i]}" for i in side if alloc.gpus[i] < want]
        if short:
            issues.append(ConfigIssue(key, f"more GPUs per node than the allocation gives "
                                      f"(node:GPUs {' '.join(short)}); request --gpus-per-node={want}", want))
    return issues


def plan_nodes(cfg, alloc: Allocation) -> list[NodePlan]:
    """Assign roles and Ray resources to every node (the convention in the module docstring)."""
    cl = cfg.cluster
    trainer, rollout = _role_indices(cfg, alloc)
    cpu = _uses_cpu(cfg, alloc)
    plans = []
    for i, host in enumerate(alloc.hosts):
        resources: dict = {f"megarl_node_{i}": 1}
        if i == 0:
            resources["megarl_head"] = 1
        roles = []
        if i in trainer:
            roles.append("trainer")
            resources["megarl_trainer"] = cl.trainer_devices_per_node
        if i in rollout:
            roles.append("rollout")
            resources["megarl_rollout"] = cl.rollout_devices_per_node
        group = alloc.het_groups[i] if alloc.het_groups is not None else 0
        plans.append(NodePlan(i, host, group, "+".join(roles) or "unused", alloc.cpus[i],
                              0 if cpu else -1, resources))
    return plans


def missing_nodes(nodes: Sequence[dict], plans: Sequence[NodePlan]) -> list[NodePlan]:
    """The planned nodes with no live raylet, matched by their ``megarl_node_<i>`` resource.

    Args:
        nodes: ``ray.nodes()`` entries (``Alive``, ``Resources``).
        plans: the nodes that must be in the cluster (role other than ``unused``, and the head).
    """
    alive = set()
    for node in nodes:
        if node.get("Alive"):
            alive |= {k for k in node.get("Resources", {}) if k.startswith("megarl_node_")}
    return [p for p in plans if f"megarl_node_{p.index}" not in alive]


def read_plan(path: str) -> list[NodePlan]:
    """Parse a plan file written by ``check``."""
    plans = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        idx, host, group, role, cpus, gpus, res = line.split(" ", 6)
        plans.append(NodePlan(int(idx), host, int(group), role, int(cpus), int(gpus), json.loads(res)))
    return plans
