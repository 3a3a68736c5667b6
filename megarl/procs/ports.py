"""megarl's one port allocator: every port a megarl process listens on or hands to another process
(engines' HTTP and store ports, an engine's multi-node rendezvous, the trainer's rendezvous,
weight-sync groups, local ranks' ``MASTER_PORT``, the retrieval service) comes from
:func:`find_free_port`.

It searches at or above a configured base (``rollout.engine.base_port``, ``cluster.master_port``),
within :data:`PORT_SPAN` ports of it (the range a firewalled cluster opens), or, without a base, from
a random port below the kernel's ephemeral range (never ``bind(0)``: the kernel may give that port to
an outgoing connection as its source port before the caller binds it again). A port it hands out is
reserved on the node for :data:`RESERVATION_TTL_S` (a file per port under :func:`reservation_dir`,
taken under a node-wide lock), so two groups or engines choosing at once on one node never get the
same port before either binds it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


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
