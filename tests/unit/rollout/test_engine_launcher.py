"""EngineProcess command line and environment, without starting a server (those are integration)."""
from __future__ import annotations

import os
import sys

import pytest

from megarl.config.schema import RolloutConfig
from megarl.rollout import cpu_shims
from megarl.rollout.engine_actor import EngineActor
from megarl.rollout.engine_process import EngineProcess
from megarl.rollout.engine_resources import cpu_threads_bind, resolve_device
from megarl.rollout.local_engines import launch_engines

pytestmark = pytest.mark.timeout(30)


def _flag(cmd: list[str], name: str):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_command_and_environment_apply_shims_only_to_the_server():
    engine = EngineProcess("/models/m", port=31000, device="cpu", dtype="float32", tp_size=2,
                           max_total_tokens=4096, mem_fraction_static=0.05,
                           enable_return_routed_experts=True,
                           custom_weight_loaders=["pkg.mod.load"], extra_args=["--foo", "1"],
                           env={"OMP_NUM_THREADS": "1"})
    cmd = engine.command()
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert (_flag(cmd, "--device"), _flag(cmd, "--attention-backend"),
            _flag(cmd, "--sampling-backend"), _flag(cmd, "--dtype"), _flag(cmd, "--tp")) == (
        "cpu", "torch_native", "pytorch", "float32", "2")
    assert _flag(cmd, "--custom-weight-loader") == "pkg.mod.load"
    assert "--enable-return-routed-experts" in cmd and cmd[-2:] == ["--foo", "1"]
    assert _flag(cmd, "--host") == "127.0.0.1"

    base = {"PYTHONPATH": "/a", "PATH": "/bin"}
    env = engine.environment(base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu_shims.shim_dir()), "/a"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert base == {"PYTHONPATH": "/a", "PATH": "/bin"}  # not mutated
    assert "sgl_kernel" not in sys.modules  # the shims never enter this process


def test_cuda_command_has_no_cpu_shims():
    engine = EngineProcess("/models/m", port=31000, device="cuda")
    cmd, env = engine.command(), engine.environment({"PYTHONPATH": "/a"})
    assert _flag(cmd, "--device") == "cuda" and "--attention-backend" not in cmd
    assert env == {"PYTHONPATH": "/a"}


def test_cpu_threads_bind_splits_cores_evenly():
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        cpu_threads_bind(3, [0, 1])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="tp_size"):
        EngineProcess("/m", tp_size=0, device="cpu")
    with pytest.raises(RuntimeError, match="after start"):
        _ = EngineProcess("/m", device="cpu").url


def test_external_engines_launch_nothing():
    cfg = RolloutConfig(external_engine_urls=["http://10.0.0.1:30000"])
    assert launch_engines(cfg, "/m", device="cpu") == []


def _on_cluster(monkeypatch, node_ip: str, node_ips: list[str]) -> None:
    """EngineActor as if Ray had placed it on ``node_ip`` of a cluster with nodes at ``node_ips``."""
    from megarl.rollout import engine_actor

    monkeypatch.setattr(engine_actor, "_cluster_addresses", lambda: (node_ip, node_ips), raising=False)


def test_engine_actor_advertises_node_address_for_wildcard_bind(monkeypatch):
    _on_cluster(monkeypatch, "10.1.2.3", ["10.1.2.3"])
    assert EngineActor("/m", device="cpu", host="0.0.0.0", port=31001).url() == "http://10.1.2.3:31001"
    assert EngineActor("/m", device="cpu", port=31002).url() == "http://127.0.0.1:31002"


def test_default_engine_host_is_reachable_from_other_nodes(monkeypatch):
    # Issue 18 item 7: with the config's default host the engine bound and advertised 127.0.0.1,
    # which the rollout worker and the weight-sync sender on another node cannot reach.
    from megarl.config.schema import EngineConfig

    default_host = EngineConfig().host
    _on_cluster(monkeypatch, "10.231.0.2", ["10.231.0.1", "10.231.0.2"])  # engine on node2 of two
    actor = EngineActor("/m", device="cpu", host=default_host, port=31003)
    assert actor.url() == "http://10.231.0.2:31003"
    assert _flag(actor.engine.command(), "--host") == "10.231.0.2"  # binds the address it advertises
    # Every Ray node on one host (one machine, or the single-namespace local Slurm): loopback.
    _on_cluster(monkeypatch, "127.0.0.1", ["127.0.0.1", "127.0.0.1"])
    assert EngineActor("/m", device="cpu", host=default_host, port=31004).url() == "http://127.0.0.1:31004"
    _on_cluster(monkeypatch, "10.0.0.7", ["10.0.0.7"])
    assert EngineActor("/m", device="cpu", host=default_host, port=31005).url() == "http://127.0.0.1:31005"
    # Outside Ray (EngineProcess on its own): this host only.
    assert EngineProcess("/m", device="cpu", host=default_host, port=31006).url == "http://127.0.0.1:31006"


def test_loopback_engine_host_on_a_multi_host_cluster_is_refused(monkeypatch):
    _on_cluster(monkeypatch, "10.231.0.2", ["10.231.0.1", "10.231.0.2"])
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(ValueError, match=f"rollout.engine.host={host} is a loopback address.*10.231.0.1"):
            EngineActor("/m", device="cpu", host=host, port=31007)
    assert EngineActor("/m", device="cpu", host="10.231.0.2", port=31008).url() == "http://10.231.0.2:31008"


@pytest.mark.timeout(150)
def test_engine_expert_parallel_size_reaches_sglangs_own_parser():
    """``rollout.engine.expert_parallel_size`` becomes ``--ep-size``, and SGLang 0.5.23's own
    argument parser (``ServerArgs.add_cli_args``, in a child process: importing SGLang is heavy)
    reads it as ``ep_size``."""
    import json
    import subprocess

    from omegaconf import OmegaConf

    from megarl.cluster.ray_engines import engine_kwargs

    rollout = OmegaConf.merge(OmegaConf.structured(RolloutConfig),
                              {"engine": {"tensor_parallel_size": 4, "expert_parallel_size": 4}})
    cfg = OmegaConf.create({"rollout": OmegaConf.to_container(rollout),
                            "train": {"routing_replay": "r3"}, "cluster": {"placement": "disaggregated"}})
    engine = EngineProcess("/models/m", port=31000, device="cuda",
                           **{k: v for k, v in engine_kwargs(cfg, device="cuda", log_path=None, engine_id="e0").items()
                              if k not in ("device", "log_path", "engine_id")})
    cmd = engine.command()
    assert (_flag(cmd, "--tp"), _flag(cmd, "--ep-size")) == ("4", "4")
    parse = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
             "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
             "a = p.parse_args(sys.argv[1:])\n"
             "print(json.dumps([a.tp_size, a.ep_size, a.enable_return_routed_experts, a.sleep_on_idle]))")
    out = subprocess.run([sys.executable, "-c", parse, *cmd[3:]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [4, 4, True, True]  # sleep_on_idle: config default
    with pytest.raises(ValueError, match="ep_size"):
        EngineProcess("/models/m", tp_size=4, ep_size=3)


def test_free_ports_are_taken_below_the_ephemeral_range():
    """A rendezvous port must not be one the kernel may hand to an outgoing connection meanwhile
    (the EADDRINUSE a weight-sync group hit with Ray and engines on one host)."""
    import socket

    from megarl.procs.ports import find_free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {find_free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # free indeed
