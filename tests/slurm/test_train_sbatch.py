"""slurm/train.sbatch on a real local Slurm (2 emulated nodes), with the probe driver: a lost node
ends the job within 60 s naming the node, a node that never joins ends it (bounded), and a config
bigger than the allocation fails before Ray starts. Ray spanning both nodes with the documented
placement is shown by the real run (test_megarl_train.py::test_megarl_train_cpu_recipe_on_two_nodes)."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import job_processes, submit, wait_no_job_processes

pytestmark = pytest.mark.slurm


def _ray_start_logs(job_dir: Path) -> list[Path]:
    return sorted(job_dir.glob("ray-*.log"))


def _kill_raylet_when_ready(env: dict, node: str, killed: dict):
    """on_running hook: once the probe driver holds, SIGKILL the raylet of ``node`` (our own job's)."""
    def hook(job_id: str) -> None:
        # ~25 s on a quiet machine; one CI dry run needed over 200 s (submit allows 360 s in all,
        # 60 of them for the job to end after the kill)
        deadline = time.monotonic() + 290
        while not list(Path(env["MEGARL_LOG_ROOT"]).glob(f"*-{job_id}/run/probe.ready")):
            assert time.monotonic() < deadline, "the probe driver never got ready"
            time.sleep(0.5)
        for pid in job_processes(job_id):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if comm == "raylet" and f"SLURMD_NODENAME={node}\0".encode() in environ:
                os.kill(pid, signal.SIGKILL)
                killed["t"] = time.monotonic()
                return
        raise AssertionError(f"no raylet of job {job_id} found on {node}")
    return hook


@pytest.mark.timeout(400)
def test_lost_node_stops_the_job_within_60s_naming_it(job_env, probe_config):
    env = {**job_env, "PROBE_HOLD_S": "900"}  # the driver would otherwise wait 15 minutes
    killed: dict = {}
    r = submit(env, "slurm/train.sbatch", [str(probe_config)], timeout_s=360,
               on_running=_kill_raylet_when_ready(env, "node2", killed))
    took_s = time.monotonic() - killed["t"]
    print(f"job {r.job_id} ended {took_s:.1f}s after node2's raylet was killed (status {r.rc})")
    assert r.rc == 4, r.output
    probe = json.loads((r.job_dir / "run" / "probe.json").read_text())  # written before the node was lost
    assert [t["slurmd_nodename"] for t in probe["trainer"]] == ["node1", "node1"], probe
    assert [e["slurmd_nodename"] for e in probe["engine"]] == ["node2"], probe
    assert took_s < 60, f"job ended {took_s:.0f}s after the node was lost"
    assert "node node2 (index 1, rollout" in r.output, r.output
    assert "node2" in (r.job_dir / "error.txt").read_text()
    assert wait_no_job_processes(r.job_id) == []


@pytest.mark.timeout(300)
def test_node_that_never_joins_fails_the_job_bounded(job_env, probe_config, local_slurm):
    # node2 is told to advertise an address nobody can reach (TEST-NET-1; no emulated host has a
    # route to it, so nothing is sent): its raylet never joins.
    env = {**job_env, "MEGARL_NODE_IPS": f"{local_slurm.node_address('node1')} 192.0.2.1",
           "MEGARL_RAY_JOIN_TIMEOUT_S": "15"}
    r = submit(env, "slurm/train.sbatch", [str(probe_config)])
    assert r.rc == 3, r.output
    assert "node2" in (r.job_dir / "error.txt").read_text(), r.output
    assert not (r.job_dir / "driver.log").exists(), "the driver must not start without every node"
    assert wait_no_job_processes(r.job_id) == []


@pytest.mark.timeout(200)
def test_config_bigger_than_allocation_fails_before_ray_starts(job_env, probe_config, fake_gpus):
    # 2 nodes x 2 (fake) GPUs allocated; the config asks for 3 nodes and 4 GPUs per trainer node.
    r = submit(job_env, "slurm/train.sbatch",
               [str(probe_config), "cluster.device=cuda", "train.precision=bf16",
                "cluster.trainer_nodes=2", "cluster.trainer_devices_per_node=4"],
               sbatch_opts=("--gpus-per-node=2",))
    assert r.rc == 2, r.output
    assert "cluster.trainer_nodes=2" in r.output and "allocation has 2" in r.output, r.output
    assert "cluster.trainer_devices_per_node=4" in r.output, r.output
    assert "starting the Ray head" not in r.output
    assert _ray_start_logs(r.job_dir) == [] and not (r.job_dir / "nodes.tsv").exists()
