"""Where an engine process runs: its device, its host address, a free port, its CPU cores."""
from __future__ import annotations

import os
import random
import socket
import time
from typing import Sequence


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


def _below_ephemeral_range() -> tuple[int, int]:
    """A port window below the kernel's ephemeral range (``ip_local_port_range``), where the source
    port of an outgoing connection is never assigned."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (max(1024, low - 12000), max(1025, low))


def find_free_port(host: str = "127.0.0.1", start: int | None = None) -> int:
    """A TCP port free on ``host`` now: the first free one at or above ``start``.

    Without ``start`` the search begins at a random port below the kernel's ephemeral range: a port
    the kernel hands out for ``bind(0)`` is one it may give, before the caller binds it again, to an
    outgoing connection as its source port (a rendezvous then fails with EADDRINUSE; seen with
    Ray, engines and trainer ranks on one host).
    """
    if start is None:
        low, high = _below_ephemeral_range()
        start = random.randrange(low, high)
    candidates = range(start, min(start + 1000, 65536))
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port on {host} in [{start}, {start + 1000})")


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
