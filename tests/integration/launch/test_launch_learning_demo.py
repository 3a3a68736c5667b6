"""The CPU learning demonstration: SFT cold start then GSPO raises held-out reward.

CI runs one seed (``slow``, 4.6-6.9 min on the 2-core machine); the 3-seed demonstrations are marked
``demo`` (CI leaves them out: ``bash tools/test.sh -m demo`` runs them, ~25 min each; the issue-28
drift-bound comparison trains two arms of three seeds, ~45-60 min).

Runs ``examples/arithmetic_tool/run_demo.py`` (one ``megarl train`` per seed, everything real: Megatron
ranks, SGLang, calculator tool, weight sync) and compares each run's held-out evaluation after its
last GSPO step with the same run's evaluation right after the SFT cold start (before any GSPO step).
The reward that RL maximises is the expected reward of sampled trajectories; on held-out prompts that
is ``eval/sampled_reward_mean`` (4 samples per prompt, 200 prompts: 800 trajectories, standard error
about 0.015 at the rewards seen here; the same sampling seeds at both evaluations). Greedy accuracy
must rise on average too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.testing.demos import run_demo

SEEDS = (1, 2, 3)
MIN_MEAN_GAIN = 0.03  # measured 0.063 (+0.050, +0.073, +0.067) on 2026-11-25; earlier 0.070 and 0.083
MIN_ONE_SEED_GAIN = 0.02  # seed 1 measured +0.050 (2026-11-25), +0.105, +0.085; the evaluations share prompts and seeds
# Issue 16: async mode must gain no less than sync mode's mean gain minus one (population) std over
# the same seeds: sync measured +0.050, +0.073, +0.067 (2026-11-25): mean 0.063, std 0.010.
SYNC_MEAN_GAIN, SYNC_GAIN_STD = 0.063, 0.010
# Issue 28: staleness by measured drift. AReaL's decoupled objective in async mode, two arms: the
# fixed bound (max_staleness 2) and max_staleness 4 with trajectories over DRIFT_BOUND dropped
# (k3_mean, nats per token). DRIFT_BOUND is the largest per-trajectory drift the fixed arm trained on,
# seed 1 (max over its 30 steps of mismatch/behaviour_drift_max: 0.0271), rounded up to two digits:
# the bound admits what staleness 2 admits and drops what drifts further. The fixed arm carries a bound
# no trajectory reaches (MEASURE_ONLY) so that it logs the drift it trains on and drops nothing.
ASYNC = ("rollout.async_mode=true", "algorithm.rollout_correction=decoupled")
DRIFT_BOUND, MEASURE_ONLY = 0.028, 1.0e6
# Measured 2026-11-27 (held-out sampled reward after GSPO, seeds 1-3): fixed 0.214, 0.271, 0.281 (gains
# +0.111, +0.110, +0.046: mean 0.089, population std 0.030); drift 0.179, 0.224, 0.295 (mean 0.233 against
# 0.255: 0.023 lower, lower on seeds 1-2). The tolerance is one std of the fixed arm's gains, the rule the
# async arm meets against sync above: the drift arm may lose no more than the seed-to-seed spread of the
# gain it is compared with (it passed by 0.007).
DRIFT_TOLERANCE = 0.030


def _run_demo(out: Path, seeds: tuple[int, ...], timeout_s: float, *args: str) -> dict:
    return run_demo("examples/arithmetic_tool/run_demo.py", out, seeds, timeout_s, *args)


@pytest.mark.slow
@pytest.mark.ci  # one seed of each learning demonstration runs in CI
@pytest.mark.timeout(1200)
def test_gspo_raises_held_out_reward_on_one_seed(tmp_path):
    out = tmp_path / "demo"
    result = _run_demo(out, SEEDS[:1], timeout_s=1150)
    run = result["runs"][0]
    before, after = run["before"], run["after"]
    assert before["eval/tool_calls_mean"] > 0.9, "the SFT cold start taught the tool call"
    assert after["eval/sampled_reward_mean"] >= before["eval/sampled_reward_mean"] + MIN_ONE_SEED_GAIN, run
    log = (out / f"seed{run['seed']}" / "train.log").read_text()
    assert "SFT cold start" in log and f"step {run['steps']}/{run['steps']}" in log


@pytest.mark.demo
@pytest.mark.timeout(3600)
def test_gspo_raises_held_out_reward_over_three_seeds(tmp_path):
    out = tmp_path / "demo"
    result = _run_demo(out, SEEDS, timeout_s=3500)
    for run in result["runs"]:
        before, after = run["before"], run["after"]
        assert after["eval/sampled_reward_mean"] > before["eval/sampled_reward_mean"], run
        assert before["eval/tool_calls_mean"] > 0.9, "the SFT cold start taught the tool call"
        log = (out / f"seed{run['seed']}" / "train.log").read_text()
        assert "SFT cold start" in log and f"step {run['steps']}/{run['steps']}" in log
    summary = result["summary"]
    gain = summary["after/eval/sampled_reward_mean"]["mean"] - summary["before/eval/sampled_reward_mean"]["mean"]
    assert gain >= MIN_MEAN_GAIN, summary
    assert summary["after/eval/accuracy"]["mean"] > summary["before/eval/accuracy"]["mean"], summary


@pytest.mark.demo
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("variant", ["async_staleness2", "qwen3_template"])
def test_gspo_variant_raises_held_out_reward_on_every_seed(tmp_path, variant):
    """Asynchronous RL (issue 16: ``max_staleness`` 2, decoupled objective) and the official Qwen3
    template with thinking off (issue 17): held-out sampled reward rises on every seed."""
    args = {"async_staleness2": ["rollout.async_mode=true", "rollout.max_staleness=2",
                                 "algorithm.rollout_correction=decoupled"],
            "qwen3_template": ["--chat-template", "qwen3"]}[variant]
    result = _run_demo(tmp_path / variant, SEEDS, 3500, *args)
    gains = [run["after"]["eval/sampled_reward_mean"] - run["before"]["eval/sampled_reward_mean"]
             for run in result["runs"]]
    for run, gain in zip(result["runs"], gains):
        assert gain > 0, run
        assert run["before"]["eval/tool_calls_mean"] > 0.9, run
    if variant == "async_staleness2":  # measured +0.061, +0.064, +0.076 (mean 0.067)
        assert sum(gains) / len(gains) >= SYNC_MEAN_GAIN - SYNC_GAIN_STD, gains


def _trained_steps(run_dir: Path) -> list[dict]:
    """The metrics of the run's RL steps that trained on at least one trajectory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] >= 1 and r.get("filter/kept_trajectories", 0) > 0]


@pytest.mark.demo
@pytest.mark.timeout(5400)
def test_drift_bound_at_staleness4_keeps_reward_of_fixed_staleness2(tmp_path):
    """Issue 28: at ``max_staleness`` 4 with ``max_behaviour_drift`` the held-out sampled reward after
    GSPO is at least that of the fixed bound (``max_staleness`` 2) over three seeds, within
    DRIFT_TOLERANCE; the drift is logged on every step that trains, the fixed arm drops nothing, and
    the bound drops trajectories in the staleness-4 arm (measured: 1.1%, 8.2% and 0.6% of a step's
    trajectories on average)."""
    fixed = _run_demo(tmp_path / "fixed_s2", SEEDS, 2650, *ASYNC, "rollout.max_staleness=2",
                      f"algorithm.max_behaviour_drift={MEASURE_ONLY}")
    drift = _run_demo(tmp_path / "drift_s4", SEEDS, 2650, *ASYNC, "rollout.max_staleness=4",
                      f"algorithm.max_behaviour_drift={DRIFT_BOUND}")
    dropped = 0.0
    for arm, result in (("fixed_s2", fixed), ("drift_s4", drift)):
        for run in result["runs"]:
            steps = _trained_steps(tmp_path / arm / f"seed{run['seed']}")
            assert steps and all("mismatch/behaviour_drift_mean" in r for r in steps), (arm, run)
            if arm == "fixed_s2":
                assert all(r["filter/dropped_drift_frac"] == 0 for r in steps), run
            else:
                dropped += sum(r["filter/dropped_drift_frac"] for r in steps)
    assert dropped > 0, "the drift bound dropped no trajectory at staleness 4"
    reward = {arm: result["summary"]["after/eval/sampled_reward_mean"]["mean"]
              for arm, result in (("fixed_s2", fixed), ("drift_s4", drift))}
    assert reward["drift_s4"] >= reward["fixed_s2"] - DRIFT_TOLERANCE, reward
