"""The Search-R1 demonstration: after the cold start, GSPO raises held-out exact-match reward.

Runs ``examples/search_r1/run_demo.py`` (corpus from the installed Wikipedia package, BM25 index,
copy-pretrained tiny model, then per seed one ``megarl train``: the retrieval service in its own
process beside the SGLang engine, multi-turn search rollouts with observations masked from the loss,
Megatron ranks, weight sync) and compares each run's held-out evaluation after its last GSPO step
with the same run's evaluation right after the SFT cold start. The held-out questions come from
articles disjoint from the training ones; the reward is Search-R1's normalised exact match of the
title. CI runs one seed (``slow``); ``demo`` runs three.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.testing.demos import run_demo

SEEDS = (1, 2, 3)
MIN_GAIN = 0.02  # held-out sampled reward (mean@4 over 200 questions: 800 trajectories)


def _run_demo(out: Path, seeds: tuple[int, ...], timeout_s: float) -> dict:
    return run_demo("examples/search_r1/run_demo.py", out, seeds, timeout_s)


def _check_run(out: Path, run: dict) -> None:
    before, after = run["before"], run["after"]
    assert before["eval/tool_calls_mean"] > 0.9, "the SFT cold start taught the search call"
    assert after["eval/sampled_reward_mean"] >= before["eval/sampled_reward_mean"] + MIN_GAIN, run
    log = (out / f"seed{run['seed']}" / "train.log").read_text()
    assert "SFT cold start" in log and f"step {run['steps']}/{run['steps']}" in log
    assert "retrieval service (bm25" in log, "megarl started the retrieval service"


@pytest.mark.slow
@pytest.mark.ci  # one seed of each learning demonstration runs in CI
@pytest.mark.timeout(1800)
def test_gspo_raises_held_out_search_reward_on_one_seed(tmp_path):
    out = tmp_path / "search"
    result = _run_demo(out, SEEDS[:1], timeout_s=1750)
    _check_run(out, result["runs"][0])


@pytest.mark.demo
@pytest.mark.timeout(3600)
def test_gspo_raises_held_out_search_reward_on_every_seed(tmp_path):
    out = tmp_path / "search"
    result = _run_demo(out, SEEDS, timeout_s=3500)
    for run in result["runs"]:
        _check_run(out, run)
