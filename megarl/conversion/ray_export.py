"""The Megatron -> HF export spread over the nodes of a Ray cluster (issue 35 item 3).

:func:`megarl.conversion.convert.megatron_to_hf_dir` with ``nodes`` (the run's export when Ray spans
several nodes, :func:`export_nodes`): instead of every part on the driver's machine, whose disk and
NIC would carry the whole 1.3-2 TB of a DeepSeek-V3-sized model, each node runs a few of the parts.

What a part needs: :func:`megarl.conversion.parallel_export.export_rank` names its groups and files
from ``(part, parts)`` alone (every rank plans every part) and runs no collective; it initialises
``torch.distributed`` and Megatron's parallel state only to build the TP=1 meta model, for which any
world size does (its ranks are data-parallel replicas). So the parts of one node run as one local
gloo group of that node's size (:func:`megarl.procs.local_ranks.run_ranks` inside one Ray task per
node, pinned to it by node affinity), each told its global part index and the part count; no group
spans nodes.

Steps: one probe task per node returns how many parts its available memory holds
(:func:`~megarl.conversion.parallel_export.ranks_within_memory`, at most ``max_ranks_per_node`` and
one per CPU); the parts are numbered node after node (:func:`assign_parts`); one task per node
writes its parts' shards into the shared output directory and returns their
:class:`~megarl.conversion.parallel_export.RankExport`; the caller merges the index from them. The
tasks reserve no CPU (``num_cpus=0``): the run's actors hold the nodes' CPU resources, and the export
is I/O-bound background work that must not wait for them.

Shared filesystem: every node reads the checkpoint and writes the output where the driver named
them, so both must be on a filesystem every node mounts (a multi-node run's run directory is). A
node that cannot see either fails its task with a ``FileNotFoundError`` naming the node and the
path; the export fails (and :class:`megarl.launch.hf_export.BackgroundExport` retries, then reports it).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megarl.conversion.parallel_export import RankExport

logger = logging.getLogger("megarl.conversion")

PROBE_TIMEOUT_S = 300.0
"""Limit of the per-node probes (a Ray worker start on a busy node)."""
TASK_GRACE_S = 120.0
"""The driver waits this long past the export's limit (the tasks' own ``run_ranks`` limit) before
cancelling them: their start-up on the node and the return of their results."""


@dataclass(frozen=True)
class PartResult:
    """One part of an export over nodes, as its task returned it.

    Attributes:
        node_id: the Ray node id that ran it.
        index: its part index (0 .. parts-1).
        part: its groups, files and shards (for the merged index).
    """
    node_id: str
    index: int
    part: RankExport


def export_nodes() -> list[str]:
    """The ids of the live nodes of the Ray cluster this process is connected to, when there are
    several (an export over them pays off); else an empty list (no Ray, or one node)."""
    import ray

    if not ray.is_initialized():
        return []
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    return nodes if len(nodes) > 1 else []


def assign_parts(node_ranks: Sequence[tuple[str, int]]) -> list[tuple[str, tuple[int, ...]]]:
    """Number the parts node after node: ``[(node_id, its part indices)]``, consecutive indices.

    Raises:
        ValueError: a node with fewer than one part.
    """
    out, start = [], 0
    for node, count in node_ranks:
        if count < 1:
            raise ValueError(f"node {node}: {count} export parts; every node takes at least one")
        out.append((node, tuple(range(start, start + count))))
        start += count
    return out


def _node_ranks(total_bytes: int, num_layers: int, max_ranks: int) -> tuple[str, int]:
    """(Ray task) This node's id and the parts its available memory and CPUs hold."""
    import ray

    from megarl.conversion.parallel_export import available_memory_bytes, ranks_within_memory

    cpus = max(1, min(int(max_ranks), os.cpu_count() or 1))
    return (ray.get_runtime_context().get_node_id(),
            ranks_within_memory(total_bytes, num_layers, available_memory_bytes(), cpus))


def check_visible(ckpt_dir: str, out_dir: str, where: str) -> None:
    """Raise ``FileNotFoundError`` unless this machine sees the checkpoint and the output directory.

    Args:
        ckpt_dir: the dist checkpoint (its ``metadata.json`` must be readable).
        out_dir: the directory the part writes into (created by the driver).
        where: the node, for the message.
    """
    for path, ok in ((Path(ckpt_dir, "metadata.json"), Path.is_file), (Path(out_dir), Path.is_dir)):
        if not ok(path):
            raise FileNotFoundError(
                f"HF export part on {where}: {path} is not visible there; an export over several nodes needs "
                "the checkpoint and the output on a filesystem every node mounts (the run directory of a "
                "multi-node run)")


def _export_node_part(local_rank: int, local_size: int, part_indices: tuple[int, ...], parts: int,
                      *args) -> RankExport:
    """One local rank of a node's task: global part ``part_indices[local_rank]`` of ``parts``."""
    from megarl.conversion.parallel_export import export_rank

    return export_rank(part_indices[local_rank], parts, *args)


def _node_parts(part_indices: tuple[int, ...], parts: int, args: tuple, timeout_s: float,
                preload: tuple[str, ...]) -> tuple[str, list]:
    """(Ray task) Run this node's parts as one local gloo group; ``(node id, their RankExports)``."""
    import ray

    from megarl.procs.local_ranks import run_ranks

    node = ray.get_runtime_context().get_node_id()
    check_visible(args[0], args[1], f"node {node} ({socket.gethostname()})")
    return node, run_ranks(_export_node_part, len(part_indices), timeout_s=timeout_s,
                           args=(part_indices, parts, *args), preload=preload)


def _pinned(fn, node: str):
    """``fn`` as a Ray task on ``node`` (hard affinity), reserving no CPU, never retried by Ray."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))


def export_parts_on_nodes(nodes: Sequence[str], ckpt_dir: str, out_dir: str, config_dir: str, dtype: str | None,
                          max_shard_bytes: int, *, max_ranks_per_node: int, timeout_s: float | None = None,
                          preload: Sequence[str] = ()) -> list[PartResult]:
    """Run every part of an export on ``nodes`` (module docstring); blocks until all returned.

    Args:
        nodes: Ray node ids (:func:`export_nodes`).
        ckpt_dir, out_dir, config_dir, dtype, max_shard_bytes: as
            :func:`~megarl.conversion.parallel_export.export_rank` (paths every node sees).
        max_ranks_per_node: parts per node at most (fewer where its memory or CPUs hold fewer).
        timeout_s: the parts' wall-clock limit; default sized from the checkpoint's bytes and the
            part count (:func:`~megarl.conversion.parallel_export.export_timeout_s`).
        preload: what each node's fork server imports once (``run_ranks(preload=...)``).

    Returns:
        The parts in index order (their files, concatenated, are the export's files).

    Raises:
        FileNotFoundError: a node cannot see the checkpoint or the output (as a ``RayTaskError``).
        megarl.procs.local_ranks.RankError: a part failed or ran past ``timeout_s`` (same).
        TimeoutError: the tasks did not return ``timeout_s`` + :data:`TASK_GRACE_S` after the start.
    """
    import json

    from megarl.conversion.parallel_export import checkpoint_bytes, export_timeout_s

    total = checkpoint_bytes(Path(ckpt_dir))
    layers = int(json.loads(Path(config_dir, "config.json").read_text()).get("num_hidden_layers", 1))
    probes = [_pinned(_node_ranks, node).remote(total, layers, max_ranks_per_node) for node in nodes]
    plan = assign_parts(_wait_all(probes, PROBE_TIMEOUT_S))
    parts = sum(len(indices) for _, indices in plan)
    timeout_s = export_timeout_s(total, parts) if timeout_s is None else timeout_s
    logger.info("HF export of %s: %d parts on %d nodes %s", ckpt_dir, parts, len(plan),
                {node: len(indices) for node, indices in plan})
    args = (ckpt_dir, out_dir, config_dir, dtype, max_shard_bytes)
    refs = [_pinned(_node_parts, node).remote(indices, parts, args, timeout_s, tuple(preload))
            for node, indices in plan]
    returned = _wait_all(refs, timeout_s + TASK_GRACE_S)
    return [PartResult(node, index, part) for (node, done), (_, indices) in zip(returned, plan)
            for index, part in zip(indices, done)]


def _wait_all(refs: list, timeout_s: float) -> list:
    """The tasks' results in order; the first failure (or the deadline) cancels the others and raises."""
    import ray

    deadline, pending = time.monotonic() + timeout_s, list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"HF export: {len(pending)} of {len(refs)} node tasks did not return "
                                   f"within {timeout_s:.0f} s")
            ray.get(ready[0])  # a failed part raises here, at once
        return ray.get(refs)
    except BaseException:
        for ref in pending:  # KeyboardInterrupt in the task: run_ranks kills its processes
            ray.cancel(ref)
        raise
