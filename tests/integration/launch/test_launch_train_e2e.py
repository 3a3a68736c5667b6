"""`megarl train configs/cpu_gsm8k.yaml` end to end; a killed engine, a scheduler signal and SIGKILL + resume.

Everything is real: the CLI in a subprocess, Ray (local), two Megatron-Core ranks over gloo, an SGLang
CPU server, the sandboxed python tool, weight sync over a gloo group. Two runs of the same recipe
(deterministic sampling, checkpoints every 2 steps):

- run A, uninterrupted: the reference;
- run B, every failure in one run (one start each, to keep CI short), always the same command with
  ``MEGARL_RESUME_FILE`` set as ``slurm/train.sbatch`` sets it:
  1. its SGLang engine is SIGKILLed right after the first weight sync (the run must restart it,
     re-sync it and say so), and the driver gets SIGUSR1 (Slurm's ``--signal``) during step 2: it
     finishes the step, saves a checkpoint and exits with ``EXIT_PREEMPTED``;
  2. the same command continues the run with no resume flag; its driver is SIGKILLed during the
     step after the one it resumed at (the steps since the checkpoint are lost);
  3. the same command finishes the run.

B's steps must reproduce A's metrics (the engine failure is recovered by generating the step again
with the same prompts and seeds; each resume restores trainer, sampler and policy version).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]
MEGARL = str(Path(sys.executable).parent / "megarl")
NUM_STEPS = 4
OVERRIDES = [f"train.num_steps={NUM_STEPS}", "checkpoint.save_interval=2", "rollout.deterministic_sampling=true",
             "data.eval_interval=4", "data.max_eval_samples=4", "logging.progress_bar=false",
             f"checkpoint.hf_export_interval={NUM_STEPS}",
             "rollout.sampling.temperature=0.9"]  # != 1: the sync check must compare like with like
RUN_TIMEOUT_S = 900
COMPARED = ("rollout/reward_mean", "rollout/response_tokens_mean", "rollout/turns_mean", "filter/kept_trajectories",
            "loss/policy", "optim/grad_norm", "weight_sync/verify_logprob_diff_mean")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return env


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    log = open(run_dir.parent / f"{run_dir.name}.console.log", "ab")
    return subprocess.Popen([MEGARL, "train", "configs/cpu_gsm8k.yaml", f"logging.run_dir={run_dir}", *OVERRIDES, *extra],
                            cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _reap(proc: subprocess.Popen) -> None:
    """Kill what is left of a run's process group (Ray, engines), never anything else."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _finish(proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        _reap(proc)


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}  # a resumed run's rows replace the killed run's


def _wait_for(predicate, timeout_s: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _engine_server(port: int) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return p
    raise AssertionError(f"no SGLang server on port {port}")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("e2e") / "run_a"
    run_dir.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    code = _finish(_start(run_dir))
    assert code == 0, (run_dir.parent / "run_a.console.log").read_text()[-5000:]
    (run_dir / "wall_s.txt").write_text(f"{time.monotonic() - start:.0f}")
    return run_dir


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory) -> tuple[Path, int]:
    """Run B (module docstring); its run directory and the first start's exit status."""
    from megarl.launch.preemption import RESUME_FILE_ENV

    run_dir = tmp_path_factory.mktemp("e2e_faults") / "run_b"
    log = run_dir / "train.log"
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    os.environ[RESUME_FILE_ENV] = str(run_dir.parent / "resume_run_dir")
    try:
        proc = _start(run_dir)
        try:
            _wait_for(lambda: "weight sync -> policy version 0" in text(), RUN_TIMEOUT_S, proc, "the first sync")
            port = int(re.search(r"engine0 ready at http://[\d.]+:(\d+)", text()).group(1))
            os.killpg(_engine_server(port).pid, signal.SIGKILL)  # the engine this run started
            _wait_for(lambda: f"step 1/{NUM_STEPS}" in text(), RUN_TIMEOUT_S, proc, "step 1")
            os.kill(proc.pid, signal.SIGUSR1)  # the driver only: it must finish the step and save
            first = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            _reap(proc)
        assert first != 0, (run_dir.parent / "run_b.console.log").read_text()[-5000:]
        resumed = text().count("resumed at step")
        proc = _start(run_dir)  # the same command: $MEGARL_RESUME_FILE continues the run
        try:
            _wait_for(lambda: text().count("resumed at step") > resumed, RUN_TIMEOUT_S, proc, "the resume")
            step = int(re.findall(r"resumed at step (\d+)", text())[-1])
            _wait_for(lambda: f"step {step + 1}/{NUM_STEPS}" in text(), RUN_TIMEOUT_S, proc, f"step {step + 1}")
            os.kill(proc.pid, signal.SIGKILL)  # the driver only; Ray and the engine must not outlive it
            proc.wait(timeout=60)
        finally:
            _reap(proc)
        code = _finish(_start(run_dir))
        assert code == 0, (run_dir.parent / "run_b.console.log").read_text()[-5000:]
    finally:
        del os.environ[RESUME_FILE_ENV]
    return run_dir, first


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_cpu_gsm8k_recipe_end_to_end(reference_run):
    rows = _metrics(reference_run)
    assert sorted(rows) == list(range(NUM_STEPS + 1))  # step 0 = evaluation before training
    for step in range(1, NUM_STEPS + 1):
        m = rows[step]
        assert m["policy_version"] == step and m["engine/weight_version"] == step  # synced every step
        assert m["weight_sync/verify_logprob_diff_mean"] < 1e-3  # engine == trainer after the sync
        assert m["rollout/num_trajectories"] == 32 and m["optim/update_successful"] == 1.0
    assert max(rows[s]["rollout/turns_mean"] for s in rows if s) > 1.0  # multi-turn tool rollouts
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[NUM_STEPS]
    log = (reference_run / "train.log").read_text()
    assert "rendezvous 127.0.0.1:" in log  # a single-host run binds and advertises loopback only
    assert len(re.findall(r"engine weight_version \d+ \| logprob mismatch: rollouts [\d.e+-]+, after sync [\d.e+-]+",
                          log)) == NUM_STEPS
    for png in ("reward.png", "mismatch.png"):
        assert (reference_run / png).stat().st_size > 5000
    assert list((reference_run / "tensorboard").glob("events.out.tfevents.*"))
    assert (reference_run / "checkpoints" / "latest").read_text().strip() == f"step_{NUM_STEPS:06d}"
    # a readable console: megarl's lines only (megarl.logging_setup filters the known third-party noise)
    console = (reference_run.parent / "run_a.console.log").read_text(errors="replace")
    noise = re.findall(r".*(?:UserWarning|FutureWarning|DeprecationWarning|sglang\.srt\.function_call).*", console)
    assert not noise, "\n".join(noise[:10])
    trajectories = [json.loads(line) for line in (reference_run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(trajectories) == rows[1]["rollout/num_trajectories"]
    assert all(t["response"] and t["response_tokens"] > 0 and t["policy_version"] == 0 for t in trajectories)
    assert (reference_run / "ray_logs").is_dir()  # the Ray session's worker logs, linked from the run


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_megarl_show_reads_the_run(reference_run):
    """``megarl show`` on the recipe's run directory (issue 29 §3): every trajectory of step 1 shown,
    its turns covering the response exactly (trained tokens = the loss mask's sum the line records)."""
    import io

    from rich.console import Console

    from megarl.launch.show import show

    rows = [json.loads(line) for line in (reference_run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    buf = io.StringIO()
    assert show(reference_run, step=1, console=Console(file=buf, width=160, color_system=None)) == len(rows)
    for row in rows:
        assert sum(t["tokens"] for t in row["turns"]) == row["response_tokens"]
        assert sum(t["tokens"] for t in row["turns"] if t["trained"]) == row["trained_tokens"]
    assert buf.getvalue().count("model turn 1 |") == len(rows)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_hf_export_every_n_steps_loads_with_transformers(reference_run):
    """``checkpoint.hf_export_interval``: the step-4 weights as a Hugging Face directory, loadable by
    transformers, with the launch model's names and shapes and trained (different) values."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.config.loader import load_config
    from megarl.models.tiny import resolve_model_path

    exported = reference_run / "hf" / f"step_{NUM_STEPS:06d}"
    assert sorted(p.name for p in (reference_run / "hf").iterdir()) == [exported.name]
    launch_path = resolve_model_path(load_config(REPO / "configs/cpu_gsm8k.yaml").model.hf_path)
    trained = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(launch_path, torch_dtype=torch.float32).state_dict()
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in initial.items()}
    changed = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert len(changed) > len(initial) // 2, "SFT + 4 GSPO steps change most weights"
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert (exported / "tokenizer_config.json").is_file() and (exported / "generation_config.json").is_file()



@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_engine_kill_signal_and_sigkill_resumes_reproduce_the_run(reference_run, faulty_run):
    from megarl.launch.preemption import EXIT_PREEMPTED

    run_dir, first_exit = faulty_run
    log = (run_dir / "train.log").read_text()
    assert "engine0 stopped answering" in log and "engine0 restarted and re-synced" in log
    assert first_exit == EXIT_PREEMPTED and "received SIGUSR1" in log and "saving a checkpoint" in log
    resumed_at = [int(s) for s in re.findall(r"resumed at step (\d+), policy version \1", log)]
    assert len(resumed_at) == 2 and 1 <= resumed_at[0] < NUM_STEPS, resumed_at  # after the signal, after SIGKILL
    expected, got = _metrics(reference_run), _metrics(run_dir)
    assert sorted(got) == sorted(expected)
    for step in range(1, NUM_STEPS + 1):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-3, abs=1e-6), (step, key)
