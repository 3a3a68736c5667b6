"""R3 routes of in-flight rollouts in a checkpoint, written without passing through the driver.

An async checkpoint saves the rollouts in flight with the driver state (so a resumed run trains on
the same trajectories). Their routes (``Trajectory.routed_experts``, ``[P + R, L, K]`` int32; ~5 GB
per step at the DeepSeek-V3 recipe) are object-store references owned by the rollout actor, which
die with the Ray session. :func:`write_routes` stores them as files beside the driver state: one Ray
task per trajectory group resolves that group's references itself (references passed as task
arguments are fetched by the task's worker, never by the driver) and writes them as
``{ckpt}/rollout_routes/{prefix}_g{group}.pt`` (a list of tensors, the group's trajectories in
order). The driver keeps only :class:`RouteFile` entries (path and index) in the pickled state. A
trainer rank resolves a :class:`RouteFile` as it resolves a reference (:func:`resolve_routes`), so
neither the checkpoint nor the resume gathers a step's routes in one process: the largest any
process holds is one group's (the writing task) or one data-parallel shard's (a trainer rank).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from megarl.rollout.route_parts import RouteParts, assemble

ROUTES_DIR = "rollout_routes"
"""The checkpoint's subdirectory of route files."""


@dataclasses.dataclass(frozen=True)
class RouteFile:
    """One trajectory's R3 routes saved with a checkpoint: tensor ``index`` of the list in ``path``.

    Attributes:
        path: absolute path of the group's file (``torch.save`` of a list of ``[L_i, L, K]`` int32).
        index: the trajectory's position in its group.
    """

    path: str
    index: int


@ray.remote(num_cpus=0)
def _write_group(path: str, *routes: Any) -> int:
    """Write one group's routes (references already fetched by Ray, :class:`RouteFile` read, tensors
    as given; None for a trajectory without routes) to ``path``; returns the bytes of the tensors."""
    tensors = resolve_routes(list(routes))
    tmp = Path(path).with_suffix(".tmp")
    torch.save(tensors, tmp)
    tmp.replace(path)
    return sum(t.nbytes for t in tensors if t is not None)


def _has_routes(group: Any) -> bool:
    return any(t.routed_experts is not None for t in group.trajectories)


def write_routes(groups: Sequence[Any], ckpt_dir: Path, prefix: str, *, timeout_s: float = 600.0) -> list[Any]:
    """Copies of ``groups`` whose trajectories hold :class:`RouteFile` entries for their routes,
    written under ``{ckpt_dir}/rollout_routes`` by one Ray task per group (module docstring).

    Trajectories of ``groups`` whose routes already were a :class:`RouteFile` (a resumed run's, in a
    checkpoint that rotation may delete) are pointed at the new file in place; references stay.

    Args:
        groups: ``TrajectoryGroup`` s of one in-flight rollout.
        ckpt_dir: the checkpoint being written.
        prefix: distinguishes the rollouts of one checkpoint (``p{k}``).

    Returns:
        The copies (a group without routes is returned as it is).

    Raises:
        ray.exceptions.RayError: a task failed (a reference lost, a write failed).
    """
    directory = ckpt_dir / ROUTES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    out, tasks = [], []
    for group in groups:
        if not _has_routes(group):
            out.append(group)
            continue
        path = str((directory / f"{prefix}_g{group.group_id}.pt").resolve())
        tasks.append(_write_group.remote(path, *[t.routed_experts for t in group.trajectories]))
        trajs = []
        for i, traj in enumerate(group.trajectories):
            saved = None if traj.routed_experts is None else RouteFile(path, i)
            if isinstance(traj.routed_experts, RouteFile):
                traj.routed_experts = saved  # in place: the old file may be rotated away
            if saved is not None:
                traj = copy.copy(traj)
                traj.routed_experts = saved
            trajs.append(traj)
        group = copy.copy(group)
        group.trajectories = trajs
        out.append(group)
    ray.get(tasks, timeout=timeout_s)
    return out


def resolve_routes(entries: Sequence[Any]) -> list[Any]:
    """Tensors for route entries: object-store references and the engine-facing workers' parts
    (:class:`~megarl.rollout.route_parts.RouteParts`, assembled) fetched together, :class:`RouteFile`
    read (each file once), tensors and None as they are.

    Raises:
        FileNotFoundError: a route file is gone; IndexError: an index beyond its file's list.
        ValueError: a part's tensor differs from its recorded shape.
    """
    refs = [e for e in entries if isinstance(e, ray.ObjectRef)]
    refs += [r for e in entries if isinstance(e, RouteParts) for r in e.refs]
    fetched = dict(zip(refs, ray.get(refs))) if refs else {}
    files: dict[str, list] = {}
    out = []
    for entry in entries:
        if isinstance(entry, ray.ObjectRef):
            entry = fetched[entry]
        elif isinstance(entry, RouteParts):
            entry = assemble(entry, [fetched[r] for r in entry.refs])
        elif isinstance(entry, RouteFile):
            if entry.path not in files:
                files[entry.path] = torch.load(entry.path, weights_only=True)
            entry = files[entry.path][entry.index]
        out.append(entry)
    return out
