"""Fixtures for tests/slurm: one real local Slurm per session (tools/local_slurm) and job helpers.

The cluster: 2 emulated nodes (node1, node2) x 4 CPUs, 2 fake GPUs each (GRES backed by placeholder
files: Slurm accounts for them, nothing can use them), each node an emulated host with its own
network namespace, loopback and address on a private bridge (node1 10.231.0.1, node2 10.231.0.2,
slurmctld on a third host; :mod:`megarl.testing.netns`) and its own ``/dev/shm`` (each slurmd in a
private mount namespace), with a private munged. Jobs find each
node's address on its ``eth0`` (``MEGARL_NODE_IFNAME``), so Ray, the trainer ranks and the engines
on different nodes reach each other only across the bridge. Started by ``tools/local_slurm/start.sh`` (which installs Debian's
Slurm when missing) and stopped by ``stop.sh`` at the end of the session. When the tests run under
``tools/local_slurm/run.sh`` (``LOCAL_SLURM_RUNNING=1``) that cluster is reused instead.
"""
from __future__ import annotations

import ast
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "tools" / "local_slurm"
NUM_GPUS = 2


@dataclass
class LocalSlurm:
    """A running local Slurm: its state directory and an environment that reaches it."""

    dir: Path
    env: dict
    gpus: int = NUM_GPUS
    """Fake GPUs per node (GRES)."""

    def node_address(self, node: str) -> str:
        """The address slurm.conf gives ``node`` (``NodeAddr``)."""
        conf = (self.dir / "etc" / "slurm.conf").read_text()
        return re.search(rf"^NodeName={node} .*NodeAddr=(\S+)", conf, re.M).group(1)

    def node_netns(self, node: str) -> str:
        """The network namespace of ``node`` (multi-host layout)."""
        names = (self.dir / "run" / "netns.created").read_text().split()
        return next(name for name in names if name.endswith(f"-{node}"))

    @property
    def multihost(self) -> bool:
        """Each node is its own emulated host (start.sh recorded one namespace per node)."""
        created = self.dir / "run" / "netns.created"
        return created.is_file() and len(created.read_text().split()) > 1


@dataclass
class JobResult:
    """A finished ``sbatch --wait`` job."""

    job_id: str
    rc: int
    output: str
    """The job's stdout+stderr file (``--output``)."""
    job_dir: Path
    """megarl's per-job log directory (MEGARL_LOG_ROOT/<job name>-<job id>)."""
    elapsed_s: float


def _start_env(d: str) -> dict:
    return {**os.environ, "LOCAL_SLURM_DIR": d, "LOCAL_SLURM_NETNS": f"megarl-t{os.getpid()}",
            "LOCAL_SLURM_NODES": "2", "LOCAL_SLURM_CPUS": "4", "LOCAL_SLURM_GPUS": str(NUM_GPUS),
            "LOCAL_SLURM_MULTIHOST": "1"}


@pytest.fixture(scope="session")
def local_slurm():
    """Start (or reuse) the local Slurm for the session; stop it by PID afterwards."""
    if os.environ.get("LOCAL_SLURM_RUNNING") == "1" and os.environ.get("LOCAL_SLURM_DIR"):
        d = Path(os.environ["LOCAL_SLURM_DIR"])
        yield LocalSlurm(d, {**os.environ, "PATH": f"{d}/bin:{os.environ['PATH']}",
                             "SLURM_CONF": str(d / "etc" / "slurm.conf")},
                         gpus=int(os.environ.get("LOCAL_SLURM_GPUS", "0")))
        return
    if os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("ip"):
        pytest.skip("the local Slurm needs root, nsenter and ip (network namespace, Slurm daemons)")
    d = tempfile.mkdtemp(prefix="mrslurm-", dir="/tmp")
    env = _start_env(d)
    stop_env = {**env, "LOCAL_SLURM_PURGE": "1"}
    # A guardian stops the cluster (by its recorded PIDs) if pytest dies without running this
    # fixture's teardown (pytest-timeout's thread method ends the process with os._exit).
    guardian = subprocess.Popen(
        ["bash", "-c", f'while kill -0 {os.getpid()} 2>/dev/null; do sleep 2; done; exec bash "$0"',
         str(LOCAL_SLURM / "stop.sh")], env=stop_env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc = subprocess.run(["bash", str(LOCAL_SLURM / "start.sh")], env=env, capture_output=True,
                              text=True, timeout=240)
        if proc.returncode != 0:
            pytest.fail(f"tools/local_slurm/start.sh failed:\n{proc.stdout}\n{proc.stderr}")
        yield LocalSlurm(Path(d), {**os.environ, "PATH": f"{d}/bin:{os.environ['PATH']}",
                                   "SLURM_CONF": f"{d}/etc/slurm.conf"})
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM / "stop.sh")], env=stop_env, capture_output=True, timeout=120)
        guardian.kill()
        guardian.wait(timeout=10)


@pytest.fixture(scope="session")
def probe_config(tiny_moe_dir, tmp_path_factory) -> Path:
    """A valid CPU config (tiny MoE, 3 GSM8K prompts): 1 trainer node x 2 ranks + 1 rollout node."""
    d = tmp_path_factory.mktemp("slurmcfg")
    rows = ROOT / "data" / "gsm8k" / "train.jsonl"
    lines = rows.read_text().splitlines()[:3] if rows.is_file() else [
        '{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}'] * 3
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    cfg = d / "probe.yaml"
    cfg.write_text(f"""extends: {ROOT}/configs/base.yaml
model: {{hf_path: {tiny_moe_dir}}}
data: {{train_path: {d}/train.jsonl, eval_path: null}}
train: {{precision: fp32, global_batch_size: 8}}
rollout: {{num_prompts_per_step: 2, group_size: 4}}
cluster: {{device: cpu, trainer_nodes: 1, trainer_devices_per_node: 2, rollout_nodes: 1,
          rollout_devices_per_node: 1}}
""")
    return cfg


def make_job_env(local_slurm: LocalSlurm, log_root: Path, ray_tmp: str) -> dict:
    """Environment for sbatch calls: wrappers on PATH, the venv, Ray temp dir ``ray_tmp`` (keep it
    short: unix socket paths must stay < 108 chars), megarl's job logs under ``log_root``."""
    # Multi-host: each node's own address (its eth0); one namespace: every node on loopback.
    address = {"MEGARL_NODE_IFNAME": "eth0"} if local_slurm.multihost else {"MEGARL_NODE_IP": "127.0.0.1"}
    return {**local_slurm.env, "MEGARL_VENV": sys.prefix, **address,
            "MEGARL_LOG_ROOT": str(log_root), "MEGARL_RAY_TMPDIR": ray_tmp,
            "MEGARL_DRIVER": f"python {ROOT}/tests/slurm/ray_probe_driver.py",
            "RAY_prestart_worker_first_driver": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def job_env(local_slurm, tmp_path) -> dict:
    """Environment for one sbatch call (:func:`make_job_env`), logs in tmp."""
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")
    yield make_job_env(local_slurm, tmp_path / "runs", ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def job_processes(job_id: str) -> list[int]:
    """PIDs of live processes started by Slurm job ``job_id`` (found by SLURM_JOB_ID in /proc/*/environ)."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if needle in (p / "environ").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


def submit(env: dict, script: str, args: list[str], *, sbatch_opts: tuple[str, ...] = (),
           timeout_s: float = 240, on_running=None) -> JobResult:
    """``sbatch --wait`` a script from the repository root and collect what the job left.

    Args:
        on_running: called with the job id once the job is submitted (e.g. to kill a node).
    """
    out_dir = Path(env["MEGARL_LOG_ROOT"]).parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--wait", "--parsable", f"--output={out_dir}/%x-%j.out", *sbatch_opts, script, *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not print a job id: {job_id!r} {proc.stderr.read()}"
    try:
        if on_running is not None:
            on_running(job_id)
        proc.wait(timeout=timeout_s)
    except BaseException:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        proc.kill()
        raise
    elapsed = time.monotonic() - t0
    outs = list(out_dir.glob(f"*-{job_id}.out"))
    output = outs[0].read_text() if outs else ""
    runs = list(Path(env["MEGARL_LOG_ROOT"]).glob(f"*-{job_id}"))
    job_dir = runs[0] if runs else Path(env["MEGARL_LOG_ROOT"]) / f"missing-{job_id}"
    return JobResult(job_id, proc.returncode, output, job_dir, elapsed)


def wait_no_job_processes(job_id: str, timeout_s: float = 30) -> list[int]:
    """Wait until no process of the job is left; return the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@functools.lru_cache(maxsize=1)
def megarl_train_ready() -> tuple[Path | None, str | None]:
    """Cheap probe of whether `megarl train` can run: ``(cpu recipe, None)`` or ``(None, reason)``.

    Ready = a CPU recipe ``configs/*cpu*.yaml``, an importable ``megarl.launch.driver.train``, and
    every ``from megarl.x import y`` (also inside functions) of the training path resolving to an
    existing module and name. A module failing on a third-party import (a GPU-only dependency) does
    not count: that is not a missing piece of megarl.
    """
    recipes = sorted(ROOT.glob("configs/*cpu*.yaml"))
    if not recipes:
        return None, "`megarl train` not ready: no CPU recipe configs/*cpu*.yaml yet"
    try:
        driver = importlib.import_module("megarl.launch.driver")
    except ImportError as e:
        return None, f"`megarl train` not ready: megarl.launch.driver does not import ({e})"
    if not callable(getattr(driver, "train", None)):
        return None, "`megarl train` not ready: megarl.launch.driver.train is missing"
    missing = set()
    for package in ("launch", "training", "rollout", "weight_sync", "conversion"):
        for path in sorted((ROOT / "megarl" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megarl"):
                    missing |= _unresolved(node.module, [a.name for a in node.names])
    if missing:
        return None, f"`megarl train` not ready: unresolved imports {', '.join(sorted(missing)[:5])}"
    return recipes[0], None


def _unresolved(module_name: str, names: list[str]) -> set[str]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        return {module_name} if (e.name or "").startswith("megarl") else set()
    except ImportError:
        return set()
    out = set()
    for name in names:
        if not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                out.add(f"{module_name}.{name}")
    return out


@pytest.fixture
def fake_gpus(local_slurm) -> int:
    """Fake GPUs per node; skips when the (reused) cluster declares fewer than 2."""
    if local_slurm.gpus < 2:
        pytest.skip("the local Slurm in use declares no GPUs (start it with LOCAL_SLURM_GPUS=2)")
    return local_slurm.gpus
