"""A Ray actor per rollout engine (cluster mode): it starts an SGLang server on its node.

The actor is thin on purpose: it owns one :class:`~megarl.rollout.engine_process.EngineProcess` on the node
Ray placed it on, and reports the URL the driver's :class:`~megarl.rollout.client.SGLangClient`
should use. Generation traffic goes straight to that URL over HTTP, never through Ray.

Usage (the launch layer does this)::

    actor = ray.remote(num_gpus=tp_size)(EngineActor).remote(model_path, tp_size=tp_size, host="0.0.0.0")
    url = ray.get(actor.start.remote(timeout_s=600))

Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor; the server process inherits it.

Port: the first free one at or above ``rollout.engine.base_port + 10 * i`` for engine ``i``, chosen
on the engine's node when it starts (:func:`megarl.rollout.engine_resources.engine_port`). An engine over several
nodes takes its rendezvous port (``--dist-init-addr``) from the same range on node-rank 0's node.

Address (``rollout.engine.host``, :func:`engine_host`): with ``auto`` (the default) the server binds
and advertises its node's Ray address when the Ray cluster spans more than one host (the rollout
worker and the trainer's weight-sync sender may sit on another node), and ``127.0.0.1`` when every
Ray node is on this host.
"""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from typing import Any

from megarl.procs.ports import find_free_port
from megarl.rollout.engine_process import EngineProcess
from megarl.rollout.engine_resources import AUTO_HOST, ENGINE_PORT_STRIDE, LOOPBACK, engine_port

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_host(host: str, node_ip: str, node_ips: Iterable[str]) -> str:
    """The address an engine binds (and, unless a wildcard, advertises) on its node.

    Args:
        host: ``rollout.engine.host``: ``auto``, an address, a host name or a wildcard.
        node_ip: the Ray address of the engine's node.
        node_ips: the Ray addresses of every alive node of the cluster.

    Returns:
        ``auto``: ``node_ip`` when some node has another address (other hosts must reach the
        engine), else ``127.0.0.1`` (a single-host run stays on loopback). Anything else as given.

    Raises:
        ValueError: ``host`` is a loopback address while the cluster spans several hosts (the
            engine would be unreachable from the other nodes); the message names the field.
    """
    multi_host = any(ip != node_ip for ip in node_ips)
    if host == AUTO_HOST:
        return node_ip if multi_host else LOOPBACK
    if multi_host and _is_loopback(host):
        others = sorted({ip for ip in node_ips if ip != node_ip})
        raise ValueError(f"rollout.engine.host={host} is a loopback address, but the Ray cluster spans "
                         f"several hosts ({node_ip} and {', '.join(others)}): the rollout worker and the "
                         f"weight-sync sender on other nodes could not reach the engine; use `auto` (the "
                         f"node's address) or an address of this node")
    return host


def _cluster_addresses() -> tuple[str, list[str]]:
    """``(this node's Ray address, every alive node's Ray address)``."""
    import ray

    return ray.util.get_node_ip_address(), [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]


class EngineActor:
    """Body of the Ray actor that owns one SGLang server process on its node.

    Args:
        model_path: model directory, readable on the actor's node.
        base_port: ``rollout.engine.base_port``; with ``engine_index``, where the port search starts
            when ``port`` is not given (None: anywhere below the ephemeral range).
        engine_index: this engine's index in the run.
        **engine_kwargs: :class:`EngineProcess` arguments (``port``, ``host``, ``tp_size``,
            ``device``, ``extra_args``, ``log_path`` ...).
    """

    def __init__(self, model_path: str | os.PathLike, *, base_port: int | None = None, engine_index: int = 0,
                 **engine_kwargs: Any) -> None:
        self.node_ip, node_ips = _cluster_addresses()
        engine_kwargs["host"] = engine_host(engine_kwargs.get("host", AUTO_HOST), self.node_ip, node_ips)
        self.base_port, self.engine_index = base_port, engine_index
        if engine_kwargs.get("nnodes", 1) > 1:
            # SGLang's cross-node broadcast queue advertises SGLANG_HOST_IP, else an address it guesses
            # (a UDP route to 8.8.8.8, the host name): pin it to the address the other nodes reach.
            host = self.node_ip if engine_kwargs["host"] in _WILDCARD_HOSTS else engine_kwargs["host"]
            engine_kwargs["env"] = {"SGLANG_HOST_IP": host, **(engine_kwargs.get("env") or {})}
        self.engine = EngineProcess(model_path, **engine_kwargs)

    def dist_init_addr(self) -> str:
        """Node-rank 0 of an engine over several nodes: ``host:port`` of its torch.distributed
        rendezvous (``--dist-init-addr``; the node's address and a port from megarl's allocator on
        this node, at or above ``base_port + ENGINE_PORT_STRIDE * engine_index`` when ``base_port``
        is set), which the engine's other node parts are started with.

        Raises:
            RuntimeError: called on another node rank.
        """
        if self.engine.node_rank != 0:
            raise RuntimeError(f"{self.engine.engine_id}: only node-rank 0 hosts the rendezvous")
        if self.engine.dist_init_addr is None:
            host = self.node_ip if self.engine.host in _WILDCARD_HOSTS else self.engine.host
            start = None if self.base_port is None else self.base_port + ENGINE_PORT_STRIDE * self.engine_index
            port = find_free_port(self.engine.host if self.engine.host not in _WILDCARD_HOSTS else "0.0.0.0", start)
            self.engine.dist_init_addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.engine.dist_init_addr

    def start(self, timeout_s: float = 600.0, dist_init_addr: str | None = None) -> str:
        """Start the server, wait until healthy, and return its URL as seen from other nodes.

        Args:
            timeout_s: how long to wait for ``/health``.
            dist_init_addr: node ranks above 0 of an engine over several nodes: node-rank 0's
                :meth:`dist_init_addr` (their ``/health`` answers once every rank joined).

        Raises:
            megarl.rollout.engine_process.EngineStartupError: with the server's log tail.
            ValueError: a node part above rank 0 without ``dist_init_addr``.
            RuntimeError: no free port at or above the base port (names the range).
        """
        if dist_init_addr is not None:
            self.engine.dist_init_addr = dist_init_addr
        if self.engine.nnodes > 1 and self.engine.dist_init_addr is None:
            raise ValueError(f"{self.engine.engine_id}: node rank {self.engine.node_rank} of {self.engine.nnodes} "
                             "needs node-rank 0's dist_init_addr")
        if self.engine.port is None and self.base_port is not None:  # chosen here: the port is free on this node
            self.engine.port = engine_port(self.engine.host, self.base_port, self.engine_index)
        self.engine.start().wait_healthy(timeout_s)
        return self.url()

    def url(self) -> str:
        """``http://<address>:<port>``: the bound address, or the node's when it is a wildcard."""
        host = self.node_ip if self.engine.host in _WILDCARD_HOSTS else self.engine.host
        return f"http://{host}:{self.engine.port}"

    def health(self) -> bool:
        """The server answers ``/health`` (node ranks above 0: their schedulers' dummy server)."""
        return self.engine.is_alive() and self.engine.health()

    def restart(self, timeout_s: float = 600.0) -> str:
        """Restart the server on the same port (launch weights; re-sync before use); URL."""
        self.engine.restart(timeout_s)
        return self.url()

    def kill(self) -> None:
        """SIGKILL the server (fault-injection in tests)."""
        self.engine.kill()

    def stop(self) -> None:
        """Stop the server."""
        self.engine.stop()

    def visible_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of the server process (what its TP ranks will see)."""
        return self.engine.environment().get("CUDA_VISIBLE_DEVICES")

    def log_tail(self) -> str:
        """The end of the server log (for the driver's error messages)."""
        return self.engine.log_tail()
