"""A run's start-up through Ray on CPU: colocated memory order and ports from the one allocator (issue 25).

1. Colocated placement: the engines release their memory before the trainer ranks are built
   (a trainer built beside the engines' KV cache and weights is what runs out of memory on a GPU),
   and resume it before the first weight sync. Observed on the real :meth:`Run.build` (real Ray,
   SGLang CPU server, Megatron-Core rank, weight sync with verification) by spies that record each
   call and then make it. On CPU the memory saver is off, so the release frees nothing; the calls,
   their order and the endpoints are the same code as on GPU.
2. R3 verification: with ``train.routing_replay: r3`` the first weight sync is verified too (the
   trainer replays the routes the engine chose for the probes). In the run of (1) it passes; with a
   k/v swap in the trainer's mapping table (``swap_kv_plugin.py``: every shape and name stays valid)
   the build fails on it. Before, R3 runs skipped the check and such a run started training.
3. Ports: the engine started through Ray listens at or above ``rollout.engine.base_port`` (a base
   above the kernel's ephemeral range, where no port-0 or random pick can land), the trainer's
   rendezvous port at or above ``cluster.master_port``, and two trainer groups asking on one node at
   once get different ports.
"""
from __future__ import annotations

import logging
import os
import re
import urllib.request
from pathlib import Path

import pytest
import ray

from megarl.cluster import colocated
from megarl.cluster.ray_engines import EngineGroup
from megarl.config.loader import load_config
from megarl.launch import run as run_module
from megarl.launch.weight_sync_stage import WeightSyncStage
from megarl.procs.ports import PORT_SPAN
from megarl.testing.local_ray import private_ray

REPO = Path(__file__).resolve().parents[3]
SWAP_KV_PLUGIN = Path(__file__).resolve().parent / "swap_kv_plugin.py"


def _ephemeral_range() -> tuple[int, int]:
    low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
    return int(low), int(high)


ENGINE_BASE = _ephemeral_range()[1] + 1 + 100  # above the ephemeral range: only a configured base lands here
MASTER_BASE = ENGINE_BASE + 2 * PORT_SPAN


def _cfg(run_dir: Path, tiny_moe_dir: Path, *extra: str):
    return load_config(REPO / "configs" / "cpu_gsm8k.yaml", [
        f"model.hf_path={tiny_moe_dir}", f"logging.run_dir={run_dir}", "cluster.placement=colocated",
        "cluster.trainer_devices_per_node=1", "parallel.expert_model_parallel_size=1", "sft.num_steps=0",
        "data.eval_interval=0", "logging.tensorboard=false", "logging.progress_bar=false", "weight_sync.verify=first",
        "train.routing_replay=r3", f"rollout.engine.base_port={ENGINE_BASE}", f"cluster.master_port={MASTER_BASE}",
        "rollout.engine.startup_timeout_s=600", *extra])  # a loaded 2-core CI machine


@pytest.fixture
def run_ray():
    """Start Ray as the run would (:func:`init_ray`), retried: on a loaded 2-core machine Ray 2.60's fixed
    30 s wait for its raylet can expire. ``Run.build`` then uses this instance; stopped here."""
    from megarl.cluster.bundles import bundle_shapes
    from megarl.cluster.placement import init_ray

    def start(cfg) -> None:
        for attempt in range(3):
            try:
                init_ray(cfg, cuda=bundle_shapes(cfg).cuda)
                return
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise

    try:
        yield start
    finally:
        ray.shutdown()


def _spy(monkeypatch, events: list, owner, name: str, label: str, results: list | None = None) -> None:
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        events.append(f"{label}:start")
        out = real(*args, **kwargs)
        events.append(f"{label}:done")
        if results is not None:
            results.append(out)
        return out

    monkeypatch.setattr(owner, name, spy)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_colocated_engines_lend_their_memory_before_the_trainer_is_built(tiny_moe_dir, tmp_path, monkeypatch,
                                                                         caplog, run_ray):
    assert ENGINE_BASE + 4 * PORT_SPAN < 65536
    events: list[str] = []
    _spy(monkeypatch, events, EngineGroup, "wait_ready", "engines_ready")
    _spy(monkeypatch, events, colocated, "release", "release")
    _spy(monkeypatch, events, colocated, "resume", "resume")
    _spy(monkeypatch, events, run_module.TrainerGroup, "__init__", "trainer_build")
    synced: list[dict] = []
    _spy(monkeypatch, events, WeightSyncStage, "push", "sync", synced)
    caplog.set_level(logging.INFO, logger="megarl.launch.trainer_group")
    cfg = _cfg(tmp_path / "run", tiny_moe_dir)
    run_ray(cfg)
    run = run_module.Run(run_module.prepare_run_dir(cfg))
    try:
        run.build(cfg)
        urls = list(run.engine_urls)
        with urllib.request.urlopen(urls[0] + "/health", timeout=30) as resp:
            assert resp.status == 200  # the engine listens on the port in its URL
    finally:
        run.close()
    first = {e: events.index(e) for e in reversed(events)}  # each event's first occurrence
    assert first["engines_ready:done"] < first["release:start"] < first["release:done"] < first["trainer_build:start"]
    assert first["trainer_build:done"] < first["resume:start"] < first["resume:done"] < first["sync:start"]
    assert events.count("release:start") == 1 and events.count("resume:start") == 1  # released once, given back
    assert synced[0]["weight_sync/verify_logprob_diff_mean"] <= float(cfg.weight_sync.verify_tolerance)  # R3
    engine_port = int(urls[0].rsplit(":", 1)[1])
    assert ENGINE_BASE <= engine_port < ENGINE_BASE + PORT_SPAN, urls
    rendezvous = [int(m.group(1)) for m in re.finditer(r"rendezvous [\d.]+:(\d+)", caplog.text)]
    assert rendezvous and MASTER_BASE <= rendezvous[0] < MASTER_BASE + PORT_SPAN, caplog.text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_r3_verification_catches_a_layout_error_that_keeps_shapes(tiny_moe_dir, tmp_path, monkeypatch, run_ray):
    monkeypatch.setenv("MEGARL_TEST_DRIVER_PID", str(os.getpid()))  # the plugin spares this process's tables
    cfg = _cfg(tmp_path / "run", tiny_moe_dir, f"plugins=[{SWAP_KV_PLUGIN}]")
    run_ray(cfg)
    run = run_module.Run(run_module.prepare_run_dir(cfg))
    try:
        with pytest.raises(Exception, match="disagrees with the trainer after the weight sync"):
            run.build(cfg)
    finally:
        run.close()


@pytest.fixture
def local_ray():
    with private_ray(num_cpus=4):
        yield


@pytest.mark.timeout(240)
def test_two_trainer_groups_on_one_node_get_different_rendezvous_ports(local_ray):
    """Rank 0 of each group picks its rendezvous port in its own process; picked at once from the same
    base (or from none), they differ, and stay in the configured range (or below the ephemeral range,
    where ``bind(0)`` ports would race with outgoing connections)."""
    from megarl.launch.trainer_group import TrainerWorker

    workers = [TrainerWorker.options(num_cpus=0).remote(0, 1, {}) for _ in range(2)]
    try:
        based = ray.get([w.node_info.remote(MASTER_BASE + PORT_SPAN) for w in workers], timeout=180)
        free = ray.get([w.node_info.remote(0) for w in workers], timeout=60)
    finally:
        for worker in workers:
            ray.kill(worker, no_restart=True)
    ports = [info[2] for info in based]
    assert ports[0] != ports[1] and all(MASTER_BASE + PORT_SPAN <= p < MASTER_BASE + 2 * PORT_SPAN for p in ports)
    ports = [info[2] for info in free]
    assert ports[0] != ports[1] and all(1024 <= p < _ephemeral_range()[0] for p in ports)
