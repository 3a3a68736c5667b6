"""Where an engine process runs: its device, its host address, a free port, its CPU cores.

Ports: :func:`find_free_port` is megarl's one port allocator (engines, the trainer's rendezvous,
weight-sync groups). It searches at or above a configured base (``rollout.engine.base_port``,
``cluster.master_port``), within :data:`PORT_SPAN` ports of it (the range a firewalled cluster
opens), or, without a base, from a random port below the kernel's ephemeral range. A port it hands
out is reserved on the node for :data:`RESERVATION_TTL_S` (a file per port under
:func:`reservation_dir`, taken under a node-wide lock), so two groups or engines choosing at once on
one node never get the same port before either binds it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence


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


PORT_SPAN = 1000
"""Ports searched from a base: a firewalled cluster opens ``[base, base + PORT_SPAN)``."""
ENGINE_PORT_STRIDE = 10
"""Engine ``i``'s search starts at ``rollout.engine.base_port + ENGINE_PORT_STRIDE * i``."""
RESERVATION_TTL_S = 600.0
"""Seconds a handed-out port stays reserved: long enough for the caller to bind it (an engine's
start, a trainer group's setup up to its rendezvous); after that, binding alone tells it is taken."""


def reservation_dir() -> Path:
    """The node's port reservations (one empty file per port; per user, in the temp directory)."""
    return Path(tempfile.gettempdir()) / f"megarl-ports-{os.getuid()}"


@contextlib.contextmanager
def _node_lock() -> Iterator[Path]:
    directory = reservation_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield directory


def _reserved(path: Path, now: float) -> bool:
    try:
        return now - path.stat().st_mtime < RESERVATION_TTL_S
    except FileNotFoundError:
        return False


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1", start: int | None = None) -> int:
    """A TCP port free on ``host`` now and not handed out on this node in the last
    :data:`RESERVATION_TTL_S`: the first such port in ``[start, start + PORT_SPAN)``; reserved for it.

    Without ``start`` the search begins at a random port below the kernel's ephemeral range: a port
    the kernel hands out for ``bind(0)`` is one it may give, before the caller binds it again, to an
    outgoing connection as its source port (a rendezvous then fails with EADDRINUSE; seen with
    Ray, engines and trainer ranks on one host).

    Args:
        host: the address the port will be bound on (``""``: every interface).
        start: the configured base port, or None.

    Raises:
        RuntimeError: no free port in the range (names it).
    """
    if start is None:
        low, high = _below_ephemeral_range()
        start = random.randrange(low, high)
    end = min(start + PORT_SPAN, 65536)
    with _node_lock() as directory:
        now = time.time()
        for port in range(start, end):
            path = directory / str(port)
            if _reserved(path, now) or not _bindable(host, port):
                continue
            path.write_text(str(os.getpid()))
            return port
    raise RuntimeError(f"no free port on {host or 'any interface'} in [{start}, {end}) (every port is taken "
                       f"or was handed out in the last {RESERVATION_TTL_S:.0f} s)")


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
