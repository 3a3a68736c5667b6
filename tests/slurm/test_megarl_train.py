"""`sbatch --wait --nodes=2 slurm/train.sbatch configs/<cpu recipe>`: a short real CPU training run
(Megatron trainer ranks on node1, the SGLang engine on node2) returns 0 on the local Slurm.

On the multi-host local Slurm (each node its own network namespace, loopback and address) the
driver and trainer ranks really sit on another host than the engine: every address a component
advertises to another host (Ray nodes, the trainer rendezvous, the engine URL) must be that host's
bridge address, and the established TCP connections sampled on the engine's host show the rollout
HTTP traffic and the weight sync crossing from node1.

The same job signalled mid-run as Slurm does it before the time limit (``#SBATCH
--signal=B:USR1@600``: USR1 to the batch shell only) stops after the step in flight with a
checkpoint, exits 75, is requeued (restart 1), resumes from that checkpoint with no flag added and
ends with the per-step metrics of the uninterrupted run (one uninterrupted job serves both tests).

Skipped, with the reason, while `megarl train` cannot run yet (:func:`megarl_train_ready`)."""
import ipaddress
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.slurm.conftest import ROOT, make_job_env, megarl_train_ready, submit, wait_no_job_processes

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NUM_STEPS = 2
# Short: 2 RL steps, no SFT cold start (so keep zero-reward groups: every step trains), no
# evaluation; 1 trainer node + 1 rollout node. Deterministic sampling: a resumed run samples what
# the uninterrupted one did. On CPU SGLang sizes its KV pool from the machine's free memory before
# and after loading the weights, which other jobs on a shared machine move: a large static fraction
# tolerates that (the pool stays capped by rollout.engine.max_total_tokens).
OVERRIDES = [f"train.num_steps={NUM_STEPS}", "sft.num_steps=0", "data.eval_interval=0",
             "algorithm.filter_zero_variance_groups=false", "rollout.deterministic_sampling=true",
             "rollout.engine.mem_fraction_static=0.5",
             "cluster.device=cpu", "cluster.placement=disaggregated", "cluster.trainer_nodes=1",
             "cluster.rollout_nodes=1"]
JOB_TIMEOUT_S = 560
COMPARED = ("rollout/reward_mean", "rollout/response_tokens_mean", "rollout/turns_mean", "filter/kept_trajectories",
            "loss/policy", "optim/grad_norm", "weight_sync/verify_logprob_diff_mean")


def _actors_by_node(job_dir: Path) -> dict[str, set[str]]:
    """Actor class names found in each node's Ray worker logs (``:actor_name:`` lines)."""
    out = {}
    for row in (job_dir / "nodes.tsv").read_text().splitlines()[1:]:
        fields = row.split("\t")
        logs = Path(fields[4].split(":", 1)[1])
        names = set()
        for f in logs.glob("worker-*.out"):
            names |= set(re.findall(r"^:actor_name:(\w+)", f.read_text(errors="replace"), re.M))
        out[fields[1]] = names
    return out


class TcpSampler:
    """Established TCP connections of emulated hosts, sampled every 0.5 s with ``ss -tnp`` while
    the job runs (connections between long-lived processes: HTTP keep-alive, process groups).

    ``seen`` holds ``(node, local "ip:port", peer "ip:port", process name)``.
    """

    def __init__(self, netns_by_node: dict[str, str]) -> None:
        self.netns_by_node = netns_by_node
        self.seen: set[tuple[str, str, str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for node, netns in self.netns_by_node.items():
                out = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "ss", "-Htnp", "state", "established"],
                                     capture_output=True, text=True, timeout=30).stdout
                for line in out.splitlines():
                    fields = line.split()
                    for name in re.findall(r'\("([^"]+)",pid=', line) or ["?"]:
                        self.seen.add((node, fields[2], fields[3], name))

    def __enter__(self) -> "TcpSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _is_loopback(address: str) -> bool:
    return address == "localhost" or ipaddress.ip_address(address).is_loopback


def _assert_cross_host(r, local_slurm, sampler: TcpSampler) -> None:
    """What node1 and node2 advertised to each other, and what crossed between them."""
    node1, node2 = local_slurm.node_address("node1"), local_slurm.node_address("node2")
    rows = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[2]) for row in rows] == [("node1", node1), ("node2", node2)]  # Ray node addresses
    log = (r.job_dir / "driver.log").read_text()
    head = re.search(r"connecting to the Ray cluster at (\S+):\d+", log).group(1)
    rendezvous = re.search(r"trainer group: \d+ ranks, rendezvous (\S+):\d+", log).group(1)
    engine_urls = re.findall(r"engine\d+ ready at http://([^:/]+):(\d+)", log)
    assert engine_urls, log[-3000:]
    advertised = [head, rendezvous, *(host for host, _ in engine_urls)]
    assert not [a for a in advertised if _is_loopback(a)], f"loopback advertised across hosts: {advertised}"
    assert (head, rendezvous) == (node1, node1) and {host for host, _ in engine_urls} == {node2}
    # The engine's HTTP port on node2 served clients on node1 (weight-sync coordinator, rollouts) ...
    engine_ports = {f"{node2}:{port}" for _, port in engine_urls}
    http_from_node1 = {c for c in sampler.seen
                       if c[0] == "node2" and c[1] in engine_ports and c[2].startswith(f"{node1}:")}
    assert http_from_node1, sorted(sampler.seen)
    # ... and the engine's own processes (the weight-sync process group) talked to node1.
    engine_to_node1 = {c for c in sampler.seen
                       if c[0] == "node2" and c[3].startswith("sglang") and c[2].startswith(f"{node1}:")}
    assert engine_to_node1, sorted(c for c in sampler.seen if c[0] == "node2")


@pytest.fixture(scope="module")
def train_recipe() -> str:
    recipe, reason = megarl_train_ready()
    if reason:
        pytest.skip(reason)
    return str(recipe.relative_to(ROOT))


def _train_env(local_slurm, tmp_path_factory, name: str):
    """A job environment running the real `megarl train` (not the probe driver); its Ray temp dir."""
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")
    env = make_job_env(local_slurm, tmp_path_factory.mktemp(name) / "runs", ray_tmp)
    del env["MEGARL_DRIVER"]
    return env, ray_tmp


@pytest.fixture(scope="module")
def reference_job(local_slurm, train_recipe, tmp_path_factory):
    """The uninterrupted job, with the TCP connections sampled on the nodes while it ran."""
    env, ray_tmp = _train_env(local_slurm, tmp_path_factory, "reference")
    sampler = TcpSampler({node: local_slurm.node_netns(node) for node in ("node1", "node2")}
                         if local_slurm.multihost else {})
    try:
        with sampler:
            r = submit(env, "slurm/train.sbatch", [train_recipe, *OVERRIDES], sbatch_opts=("--nodes=2",),
                       timeout_s=JOB_TIMEOUT_S)
        print(f"megarl train job {r.job_id} (uninterrupted): {r.elapsed_s:.0f}s")
        yield r, sampler
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _metrics(job_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (job_dir / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}  # a resumed run's rows replace the stopped run's


@pytest.mark.ci  # the one CI test of `megarl train` across two Slurm nodes (~2 min); the requeue test is not
@pytest.mark.timeout(JOB_TIMEOUT_S + 40)
def test_megarl_train_cpu_recipe_on_two_nodes(reference_job, local_slurm):
    r, sampler = reference_job
    assert r.rc == 0, r.output[-6000:]
    assert sorted(_metrics(r.job_dir)) == list(range(1, NUM_STEPS + 1))
    assert (r.job_dir / "config.yaml").is_file() and (r.job_dir / "driver.log").stat().st_size > 0
    rows = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows] == [("node1", "trainer"), ("node2", "rollout")]
    for row in rows:  # host:path of that node's Ray session logs (one machine here), and its ray start log
        assert (Path(row[4].split(":", 1)[1]) / "raylet.out").is_file(), row
    assert len(sorted(r.job_dir.glob("ray-*.log"))) == 2
    resolved = yaml.safe_load((r.job_dir / "config.yaml").read_text())  # one directory per job
    assert resolved["logging"]["run_dir"] == str(r.job_dir / "run")
    actors = _actors_by_node(r.job_dir)
    assert "TrainerWorker" in actors["node1"] and "TrainerWorker" not in actors["node2"], actors
    assert "EngineActor" in actors["node2"] and "EngineActor" not in actors["node1"], actors
    if local_slurm.multihost:
        _assert_cross_host(r, local_slurm, sampler)
    assert wait_no_job_processes(r.job_id) == []


def _job_fields(env: dict, job_id: str) -> dict[str, str]:
    """``scontrol show job -o``: the job's record as ``{key: value}``."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(1)


# Its own job, and the uninterrupted one too when it runs alone.
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 700)
def test_megarl_train_signalled_requeued_resumes_with_the_same_metrics(reference_job, local_slurm, train_recipe,
                                                                      tmp_path_factory):
    reference, _ = reference_job
    assert reference.rc == 0, reference.output[-3000:]
    env, ray_tmp = _train_env(local_slurm, tmp_path_factory, "preempted")
    log_root = Path(env["MEGARL_LOG_ROOT"])
    seen: dict = {"states": []}

    def train_log(job_id: str) -> str:
        logs = list(log_root.glob(f"*-{job_id}/run/train.log"))
        return logs[0].read_text(errors="replace") if logs else ""

    def preempt(job_id: str) -> None:
        t0 = time.monotonic()
        # Mid-run: the driver is in its first RL step (the initial weight sync is done).
        def first_step_started() -> bool:
            state = _job_fields(env, job_id).get("JobState")
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} is {state} before the signal"
            return "weight sync -> policy version 0" in train_log(job_id)
        _wait_for(first_step_started, 420, "the first weight sync")
        # What `#SBATCH --signal=B:USR1@600` does at the time limit: USR1 to the batch shell only,
        # none of its children (sbatch(1) --signal "B:", scancel(1) --batch).
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=30)
        seen["signal_s"] = time.monotonic() - t0

        def requeued_and_running() -> bool:
            fields = _job_fields(env, job_id)
            state = fields.get("JobState")
            if state and (not seen["states"] or seen["states"][-1] != state):
                seen["states"].append(state)
            return fields.get("Restarts") == "1" and state == "RUNNING"
        _wait_for(requeued_and_running, 420, "the job to be requeued and running again (Restarts=1)")
        seen["rerun_s"] = time.monotonic() - t0

    try:
        r = submit(env, "slurm/train.sbatch", [train_recipe, *OVERRIDES], sbatch_opts=("--nodes=2",),
                   timeout_s=JOB_TIMEOUT_S, on_running=preempt)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"megarl train job {r.job_id} (signalled, requeued): {r.elapsed_s:.0f}s; signal at +{seen['signal_s']:.0f}s, "
          f"running again at +{seen['rerun_s']:.0f}s; states {seen['states']}")
    assert r.rc == 0, r.output[-6000:]
    out, driver_log = r.output, (r.job_dir / "driver.log").read_text()
    log = (r.job_dir / "run" / "train.log").read_text()
    # First start: the batch shell forwarded USR1 once, the driver finished step 1, saved and exited 75.
    assert out.count("caught SIGUSR1: asking the driver") == 1, out[-6000:]
    assert log.count("received SIGUSR1") == 1 and "second stop signal" not in log + driver_log
    assert "stopping after step 1 (signal SIGUSR1); saving a checkpoint" in log, log[-4000:]
    assert "driver exited with status 75" in out and f"requeueing job {r.job_id} (restart 1)" in out
    # Slurm requeued it (pending, then running again as restart 1) ...
    assert "PENDING" in seen["states"] and seen["states"][-1] == "RUNNING", seen["states"]
    assert f"job {r.job_id} (restart 1): logs in" in out  # SLURM_RESTART_COUNT in the second start
    # ... and the same command continued the recorded run from its step-1 checkpoint.
    assert (r.job_dir / "resume_run_dir").read_text().strip() == str((r.job_dir / "run").resolve())
    resumed = re.findall(r"resuming from (\S+)", log)
    assert [Path(p).name for p in resumed] == ["step_000001"], resumed
    assert log.count("resumed at step 1, policy version 1") == 1
    assert "driver exited with status 0" in out
    # Every step's metrics equal the uninterrupted run's.
    expected, got = _metrics(reference.job_dir), _metrics(r.job_dir)
    assert sorted(got) == sorted(expected) == list(range(1, NUM_STEPS + 1))
    keys = [k for k in COMPARED if k in expected[1]]
    assert {"rollout/reward_mean", "loss/policy", "optim/grad_norm"} <= set(keys), sorted(expected[1])
    for step in expected:
        for key in keys:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-3, abs=1e-6), (step, key)
    assert wait_no_job_processes(r.job_id) == []
