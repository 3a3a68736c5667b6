"""Every port an SGLang server on CPU listens on comes from megarl's allocator (``megarl.rollout.engine_resources``).

Reference: the kernel's socket table (``psutil``) of the running server's process tree. SGLang 0.5.23
draws its torch.distributed store port (``--nccl-port``) at random in 22000-29999 when none is given;
megarl passes one it reserved, so engines, trainer groups and weight-sync groups starting at once on
one host (two test streams, or colocated ranks) never draw the same port.
"""
from __future__ import annotations

import psutil
import pytest

from megarl.procs.ports import reservation_dir


def _listening_ports(pid: int) -> set[int]:
    ports = set()
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return ports


@pytest.mark.timeout(600)  # includes the shared engine's start when this test is the first to use it
def test_engine_listens_on_the_http_and_store_ports_megarl_reserved(sglang_engine):
    cmd = sglang_engine.command()
    assert sglang_engine.nccl_port is not None
    assert cmd[cmd.index("--nccl-port") + 1] == str(sglang_engine.nccl_port)
    listening = _listening_ports(sglang_engine.pid)
    assert {sglang_engine.port, sglang_engine.nccl_port} <= listening, listening
    assert (reservation_dir() / str(sglang_engine.nccl_port)).exists()
