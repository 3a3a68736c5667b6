"""Emulated hosts on one machine: one network namespace per host, all on a private bridge.

Multi-host tests (Slurm nodes, cross-host weight sync) need processes that really sit on different
hosts: each with its own loopback and its own address, reaching the others only through that
address. This module makes such hosts out of Linux network namespaces::

    from megarl.testing.netns import emulated_hosts

    with emulated_hosts(["node1", "node2"]) as hosts:
        server = hosts["node1"].popen(["python", "-m", "http.server", "8000",
                                       "--bind", hosts["node1"].addr])
        hosts["node2"].run(["curl", f"http://{hosts['node1'].addr}:8000/"], check=True)

Layout (everything is created by :func:`emulated_hosts` and deleted by it, by name):

- a *switch* namespace ``<prefix>-br`` holding a Linux bridge ``br0`` (no address);
- one namespace ``<prefix>-<host>`` per host, with ``lo`` up and ``eth0``, one end of a veth pair
  whose other end is a port of the bridge; ``eth0`` holds the host's address in ``subnet``
  (hosts get ``.1``, ``.2``, ... in the order given), and the subnet is the only route.

Nothing is added to the machine's own network namespace: the bridge and every veth live in the
namespaces above, no namespace has a default route, and there is no NAT, so no packet from an
emulated host can leave the machine or reach its real interfaces. Two test sessions may use the
same subnet at the same time: their bridges are separate.

Commands enter a host with ``nsenter --net=/run/netns/<netns>`` (:meth:`Host.command`), which
changes only the network namespace; ``ip netns exec`` is not used, because it also remounts
``/sys``, which breaks programs that read cgroups there (slurmd).

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), ``ip`` (iproute2) and ``nsenter`` (util-linux);
:func:`unavailable_reason` says why not when they are missing, for tests to skip with.

The module is also a command for shell scripts (``tools/local_slurm``)::

    python -m megarl.testing.netns up PREFIX SUBNET HOST...   # prints "host netns addr" lines
    python -m megarl.testing.netns down PREFIX HOST...        # deletes exactly those namespaces
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

DEFAULT_SUBNET = "10.231.0.0/24"
"""Private addresses that exist only inside the namespaces made here."""

SWITCH = "br"
"""Suffix of the switch namespace's name (``<prefix>-br``); not allowed as a host name."""


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``/``nsenter``, refused)."""


@dataclass
class Host:
    """One emulated host: a network namespace with one address on the private bridge."""

    name: str
    """The host's name, as given to :func:`emulated_hosts` (e.g. ``node1``)."""
    netns: str
    """Its network namespace (``/run/netns/<netns>``)."""
    addr: str
    """Its IPv4 address on the bridge (e.g. ``10.231.0.1``); other hosts reach it there."""
    ifname: str = "eth0"
    """The interface that holds ``addr`` inside the namespace."""
    procs: list = field(default_factory=list, repr=False)
    """Processes started with :meth:`popen`; killed when the hosts are torn down."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside this host; killed at teardown if still alive."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside this host."""
        return subprocess.run(self.command(argv), **kwargs)


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else a one-line reason (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth pairs, a bridge)"
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {' and '.join(missing)} (iproute2, util-linux)"
    probe = f"mrprobe{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"`ip netns add` is not permitted here: {added.stderr.strip()}"
    bridge = subprocess.run(["nsenter", f"--net=/run/netns/{probe}", "ip", "link", "add", "br0",
                             "type", "bridge"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if bridge.returncode != 0:
        return f"cannot create a bridge in a network namespace: {bridge.stderr.strip()}"
    return None


def _ip(netns: str | None, *args: str) -> None:
    cmd = ["ip", *args] if netns is None else ["nsenter", f"--net=/run/netns/{netns}", "ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def host_addresses(names: Sequence[str], subnet: str = DEFAULT_SUBNET) -> dict[str, str]:
    """The address each host gets: the subnet's 1st, 2nd, ... usable address, in order.

    Raises:
        ValueError: duplicate names, a name equal to :data:`SWITCH`, or more hosts than addresses.
    """
    if len(set(names)) != len(names):
        raise ValueError(f"emulated host names must be distinct: {list(names)}")
    if SWITCH in names:
        raise ValueError(f"{SWITCH!r} is reserved for the switch namespace; rename that host")
    net = ipaddress.ip_network(subnet)
    usable = list(net.hosts())
    if len(names) > len(usable):
        raise ValueError(f"{len(names)} hosts do not fit in {subnet}")
    return {name: str(usable[i]) for i, name in enumerate(names)}


def create_hosts(names: Sequence[str], *, prefix: str, subnet: str = DEFAULT_SUBNET) -> dict[str, Host]:
    """Create the switch and one namespace per host (see the module docstring); no cleanup on error.

    Prefer :func:`emulated_hosts`, which always deletes what it made.

    Raises:
        NetnsUnavailable: an ``ip`` command failed (the message names it).
        ValueError: see :func:`host_addresses`.
    """
    addrs = host_addresses(names, subnet)
    prefix_len = ipaddress.ip_network(subnet).prefixlen
    switch = f"{prefix}-{SWITCH}"
    _ip(None, "netns", "add", switch)
    _ip(switch, "link", "add", "br0", "type", "bridge")
    _ip(switch, "link", "set", "br0", "up")
    hosts = {}
    for i, name in enumerate(names):
        host = Host(name=name, netns=f"{prefix}-{name}", addr=addrs[name])
        _ip(None, "netns", "add", host.netns)
        _ip(host.netns, "link", "set", "lo", "up")
        # Both veth ends are made from the switch namespace and one is moved straight into the
        # host: no interface ever appears in the machine's own namespace.
        port = f"p{i}"
        _ip(switch, "link", "add", port, "type", "veth", "peer", "name", host.ifname, "netns", host.netns)
        _ip(switch, "link", "set", port, "master", "br0")
        _ip(switch, "link", "set", port, "up")
        _ip(host.netns, "addr", "add", f"{host.addr}/{prefix_len}", "dev", host.ifname)
        _ip(host.netns, "link", "set", host.ifname, "up")
        hosts[name] = host
    return hosts


def netns_pids(netns: str) -> list[int]:
    """PIDs of the processes inside namespace ``netns`` (``ip netns pids``)."""
    proc = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()]


def destroy_hosts(names: Sequence[str], *, prefix: str) -> list[str]:
    """Delete the namespaces of ``names`` and the switch, after killing what still runs in them.

    Only namespaces named ``<prefix>-<name>`` and ``<prefix>-br`` are touched; a process inside
    one of them can only have been started there by the caller, so it is killed by PID. Missing
    namespaces are skipped. Returns the namespaces deleted.
    """
    deleted = []
    for netns in [f"{prefix}-{name}" for name in names] + [f"{prefix}-{SWITCH}"]:
        if not os.path.exists(f"/run/netns/{netns}"):
            continue
        for pid in netns_pids(netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if subprocess.run(["ip", "netns", "delete", netns], capture_output=True).returncode == 0:
            deleted.append(netns)
    return deleted


@contextlib.contextmanager
def emulated_hosts(names: Sequence[str], *, subnet: str = DEFAULT_SUBNET,
                   prefix: str | None = None) -> Iterator[dict[str, Host]]:
    """Emulated hosts ``names`` for the duration of the block: ``{name: Host}``.

    Args:
        names: host names, e.g. ``["node1", "node2"]``; each gets its own namespace and address.
        subnet: the private IPv4 subnet of the bridge; host i gets its (i+1)-th address.
        prefix: namespace name prefix; default ``mr<pid>``, unique per process. Namespace names
            are ``<prefix>-<name>`` plus ``<prefix>-br`` for the switch.

    On exit, processes started with :meth:`Host.popen` are killed, then whatever else still runs
    in these namespaces, then the namespaces (and with them the veths and the bridge) are deleted.

    Raises:
        NetnsUnavailable: the namespaces could not be created (check :func:`unavailable_reason`).
    """
    prefix = prefix or f"mr{os.getpid()}"
    hosts: dict[str, Host] = {}
    try:
        hosts = create_hosts(names, prefix=prefix, subnet=subnet)
        yield hosts
    finally:
        for host in hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)
        destroy_hosts(names, prefix=prefix)


def main(argv: Sequence[str]) -> int:
    """``up PREFIX SUBNET HOST...`` / ``down PREFIX HOST...`` (see the module docstring)."""
    if len(argv) >= 3 and argv[0] == "up":
        prefix, subnet, names = argv[1], argv[2], argv[3:]
        try:
            hosts = create_hosts(names, prefix=prefix, subnet=subnet)
        except (NetnsUnavailable, ValueError) as e:
            destroy_hosts(names, prefix=prefix)
            print(f"netns up: {e}", file=sys.stderr)
            return 1
        for host in hosts.values():
            print(host.name, host.netns, host.addr)
        return 0
    if len(argv) >= 2 and argv[0] == "down":
        for netns in destroy_hosts(argv[2:], prefix=argv[1]):
            print(f"deleted {netns}")
        return 0
    print("usage: python -m megarl.testing.netns up PREFIX SUBNET HOST... | down PREFIX HOST...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
