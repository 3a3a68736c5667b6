"""Where an engine process runs: its device, its host address, a free port, its CPU cores.

Ports: megarl's one port allocator is :mod:`megarl.procs.ports` (``find_free_port``);
:func:`engine_port` is where engine ``i``'s search starts.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from megarl.procs.ports import find_free_port


def resolve_device(device: str) -> str:
    """Map ``auto`` to ``cuda`` when a CUDA device is visible, else ``cpu``.

    Raises:
        ValueError: ``device`` is not ``auto``, ``cuda`` or ``cpu``.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"engine device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


AUTO_HOST = "auto"
"""``rollout.engine.host`` default: the engine's node address when other hosts must reach the engine
(resolved on its node by :func:`megarl.rollout.engine_actor.engine_host`), else ``127.0.0.1``."""
LOOPBACK = "127.0.0.1"


def local_host(host: str) -> str:
    """``host`` for a server used from this host only: :data:`AUTO_HOST` -> ``127.0.0.1``."""
    return LOOPBACK if host == AUTO_HOST else host


ENGINE_PORT_STRIDE = 10
"""Engine ``i``'s search starts at ``rollout.engine.base_port + ENGINE_PORT_STRIDE * i``."""


def engine_port(host: str, base_port: int, engine_index: int) -> int:
    """Engine ``engine_index``'s HTTP port: the first free one at or above ``rollout.engine.base_port
    + ENGINE_PORT_STRIDE * engine_index``, chosen on the node the engine runs on.

    Raises:
        RuntimeError: no free port in the range.
    """
    return find_free_port(host, base_port + ENGINE_PORT_STRIDE * engine_index)


def cpu_threads_bind(tp_size: int, cpus: Sequence[int] | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` value splitting ``cpus`` evenly over ``tp_size`` ranks.

    SGLang's CPU path gives each TP rank one NUMA node unless told otherwise, so TP larger than the
    NUMA node count needs an explicit split (``"0|1"`` for TP=2 on two cores).

    Raises:
        ValueError: fewer CPUs than TP ranks.
    """
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < tp_size:
        raise ValueError(f"engine tp_size={tp_size} needs at least {tp_size} CPUs, have {len(cpus)}")
    per_rank = len(cpus) // tp_size
    groups = [cpus[r * per_rank:(r + 1) * per_rank] for r in range(tp_size)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


def _wait_port_free(host: str, port: int | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while port is not None and time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError:
                time.sleep(0.2)


def check_nodes(tp_size: int, nnodes: int, node_rank: int, dist_init_addr: str | None) -> None:
    """SGLang 0.5.23's rules for an engine over ``nnodes`` nodes (``check_server_args``: the TP
    size divisible by the node count; ``NetworkAddress.parse``: ``host:port``, IPv6 bracketed)."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"engine nnodes must be >= 1 and node_rank in [0, {nnodes}), got {nnodes}, {node_rank}")
    if tp_size % nnodes:
        raise ValueError(f"engine tp_size={tp_size} must be a multiple of its nnodes={nnodes} (SGLang gives "
                         "every node tp_size / nnodes ranks)")
    if nnodes > 1 and dist_init_addr is not None:  # None until node-rank 0 picks it (EngineActor)
        host, _, port = dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or (":" in host and not host.startswith("[")):
            raise ValueError(f"an engine over {nnodes} nodes needs dist_init_addr as host:port (IPv6 in "
                             f"brackets), got {dist_init_addr!r}")
