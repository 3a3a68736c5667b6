"""``weight_sync.verify: first`` is not blind (issue 34 part 2): besides a connection's first sync
(weights equal to the engines' checkpoint, where a tensor never loaded cannot show) it checks the
first sync that changed the engines' weights."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.schema import ModelConfig, TrainConfig, WeightSyncConfig
from megarl.launch.weight_sync_stage import WeightSyncStage


def _run(verify: str, *, trained_before_rl: bool = False) -> WeightSyncStage:
    """The weight-sync stage before its first sync (no processes: only its bookkeeping runs here)."""
    stage = WeightSyncStage(WeightSyncConfig(verify=verify), TrainConfig(), ModelConfig(), trainer=None,
                            engine_urls=[], rollout_actor=None, directory=Path("unused"), probe_prompts=[])
    stage.trained_before_rl = trained_before_rl
    return stage


def _drive(stage: WeightSyncStage, versions: list) -> list:
    """Which syncs of ``versions`` are verified, with the bookkeeping ``WeightSyncStage.push`` does
    (``"connect"`` = an engine restart: ``WeightSyncStage.connect``'s reset)."""
    out = []
    for v in versions:
        if v == "connect":
            stage.synced_once, stage.verified_changed = False, False
            continue
        out.append((v, stage.verifies(v)))
        stage.synced_once, stage.synced_version = True, v
    return out


def test_first_checks_the_first_sync_and_the_first_that_changed_the_weights():
    assert _drive(_run("first"), [0, 1, 2, 3]) == [(0, True), (1, True), (2, False), (3, False)]


def test_after_sft_the_first_sync_is_the_changed_one():
    assert _drive(_run("first", trained_before_rl=True), [0, 1, 2]) == [(0, True), (1, False), (2, False)]


def test_every_n_steps_repeated_version_is_not_a_change():
    assert _drive(_run("first"), [0, 0, 2, 4]) == [(0, True), (0, False), (2, True), (4, False)]


def test_a_restarted_engine_is_checked_again_and_its_resync_counts_as_changed():
    assert _drive(_run("first"), [0, 1, 2, "connect", 2, 3]) == [
        (0, True), (1, True), (2, False), (2, True), (3, False)]


@pytest.mark.parametrize("verify, expected", [("always", True), ("off", False)])
def test_always_and_off(verify, expected):
    assert [v for _, v in _drive(_run(verify), [0, 1, 2])] == [expected] * 3

