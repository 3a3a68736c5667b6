"""megarl.testing.netns: emulated hosts reach each other by address over TCP, each has its own
loopback, nothing is added to the machine's namespace, and teardown deletes what was made."""
import subprocess
import sys
import time

import pytest

from megarl.testing.netns import DEFAULT_SUBNET, emulated_hosts, host_addresses, unavailable_reason

# A one-connection TCP server: prints "ready", answers the first client with its own bind address.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, peer = s.accept(); c.sendall(f"{sys.argv[1]} saw {peer[0]}".encode()); c.close()
"""
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    print(c.recv(100).decode())
except OSError as e:
    print(f"error {type(e).__name__}")
"""
PORT = "18571"


@pytest.fixture(scope="module")
def hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with emulated_hosts(["node1", "node2"]) as made:
        yield made


def _serve(host, bind: str) -> subprocess.Popen:
    server = host.popen([sys.executable, "-c", SERVER, bind, PORT], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def _connect(host, addr: str) -> str:
    out = host.run([sys.executable, "-c", CLIENT, addr, PORT], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_by_address(hosts):
    node1, node2 = hosts["node1"], hosts["node2"]
    assert (node1.addr, node2.addr) == ("10.231.0.1", "10.231.0.2")
    server = _serve(node1, node1.addr)
    # The server sees the client's own address: the packet crossed the bridge from node2.
    assert _connect(node2, node1.addr) == "10.231.0.1 saw 10.231.0.2"
    server.wait(timeout=10)


@pytest.mark.timeout(60)
def test_each_host_has_its_own_loopback(hosts):
    node1, node2 = hosts["node1"], hosts["node2"]
    server = _serve(node1, "127.0.0.1")
    assert _connect(node2, "127.0.0.1") == "error ConnectionRefusedError"  # node2's own loopback
    assert _connect(node1, "127.0.0.1") == "127.0.0.1 saw 127.0.0.1"
    server.wait(timeout=10)


@pytest.mark.timeout(60)
def test_hosts_have_no_route_out_and_the_machine_gains_no_address(hosts):
    for host in hosts.values():
        routes = host.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
        assert [line.split()[0] for line in routes.splitlines()] == [DEFAULT_SUBNET], routes
    machine = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert "10.231.0." not in machine


@pytest.mark.timeout(60)
def test_teardown_deletes_the_namespaces_and_kills_started_processes():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    prefix = f"mrt{int(time.time() * 1000) % 10**8}"
    with emulated_hosts(["a", "b", "c"], prefix=prefix) as made:
        assert made["c"].addr == "10.231.0.3"
        sleeper = made["a"].popen(["sleep", "600"])
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert {f"{prefix}-{n}" for n in ("a", "b", "c", "br")} <= {line.split()[0] for line in listed.splitlines()}
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed


def test_host_addresses_reject_bad_names_and_full_subnets():
    assert host_addresses(["x", "y"], "10.9.0.0/30") == {"x": "10.9.0.1", "y": "10.9.0.2"}
    with pytest.raises(ValueError, match="distinct"):
        host_addresses(["x", "x"])
    with pytest.raises(ValueError, match="reserved"):
        host_addresses(["br"])
    with pytest.raises(ValueError, match="do not fit"):
        host_addresses(["x", "y", "z"], "10.9.0.0/30")
