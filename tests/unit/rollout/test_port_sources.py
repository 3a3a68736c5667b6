"""Every port megarl hands out comes from its one allocator (``megarl.procs.ports.find_free_port``):
local ranks' ``MASTER_PORT``, the retrieval service, weight-sync groups and an engine's multi-node
rendezvous (issue 35 item 6).

References: the allocator's reservation files on disk (a port it handed out has one, a ``bind(0)``
port has none), the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, where
``bind(0)`` draws from), and the configured base (``[base, base + PORT_SPAN)``, the range a firewalled
cluster opens).
"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from megarl.procs.ports import PORT_SPAN, reservation_dir

BASE = 46000
"""Above the ephemeral range's usual start (32768), so an unbased draw below it never lands here."""


def _ephemeral_low() -> int:
    return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])


def _assert_allocated(port: int, low: int | None = None) -> None:
    assert (reservation_dir() / str(port)).exists(), f"port {port} was not reserved by megarl's allocator"
    if low is None:
        assert port < _ephemeral_low(), f"port {port} is in the kernel's ephemeral range (bind(0))"
    else:
        assert low <= port < low + PORT_SPAN, f"port {port} is outside [{low}, {low + PORT_SPAN})"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # free indeed


def test_local_ranks_master_port_comes_from_the_allocator():
    from megarl.procs.local_ranks import free_port

    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3  # reserved: never handed out twice
    for port in ports:
        _assert_allocated(port)


def test_retrieval_service_port_comes_from_the_allocator():
    from megarl.retrieval.service import RetrievalProcess, free_port

    _assert_allocated(free_port("127.0.0.1"))
    service = RetrievalProcess("/nonexistent-index", host="127.0.0.1")
    assert service.port is None  # chosen at start(); the command line shows the same source
    service.port = free_port(service.host)
    cmd = service.command()
    _assert_allocated(int(cmd[cmd.index("--port") + 1]))


@pytest.mark.parametrize("name", ["distributed", "p2p"])
def test_weight_sync_group_port_is_within_the_configured_base(name):
    from megarl.config.sync_transports import TRANSPORTS
    from megarl.weight_sync.transport import TransportOptions

    plan = SimpleNamespace(engine_layout=SimpleNamespace(tp_size=1))  # all a transport reads before connect()
    based = TRANSPORTS[name].load().from_options(plan, [], TransportOptions(master_address="127.0.0.1", port_base=BASE))
    ports = {based.group_port() for _ in range(3)}
    assert len(ports) == 3
    for port in ports:
        _assert_allocated(port, BASE)
    unbased = TRANSPORTS[name].load().from_options(plan, [], TransportOptions(master_address="127.0.0.1"))
    _assert_allocated(unbased.group_port())


def test_engine_rendezvous_port_is_within_the_engine_base(monkeypatch):
    from megarl.rollout import engine_actor

    monkeypatch.setattr(engine_actor, "_cluster_addresses", lambda: ("127.0.0.1", ["127.0.0.1"]))
    head = engine_actor.EngineActor("/m", base_port=BASE, engine_index=3, device="cpu", tp_size=2, nnodes=2,
                                    node_rank=0, host="127.0.0.1")
    host, _, port = head.dist_init_addr().rpartition(":")
    assert host == "127.0.0.1"
    _assert_allocated(int(port), BASE + engine_actor.ENGINE_PORT_STRIDE * 3)
    unbased = engine_actor.EngineActor("/m", device="cpu", tp_size=2, nnodes=2, node_rank=0, host="127.0.0.1")
    _assert_allocated(int(unbased.dist_init_addr().rpartition(":")[2]))
