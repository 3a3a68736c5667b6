"""``weight_sync.verify: first`` is not blind (issue 34 part 2): besides a connection's first sync
(weights equal to the engines' checkpoint, where a tensor never loaded cannot show) it checks the
first sync that changed the engines' weights."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.config.schema import WeightSyncConfig
from megarl.launch.weight_sync_step import verifies


def _run(verify: str, *, trained_before_rl: bool = False):
    """The run state the rule reads, as ``Run`` holds it before its first sync."""
    return SimpleNamespace(cfg=SimpleNamespace(weight_sync=WeightSyncConfig(verify=verify)), synced_once=False,
                           synced_version=None, trained_before_rl=trained_before_rl, verified_changed=False)


def _drive(run, versions: list) -> list:
    """Which syncs of ``versions`` are verified, with the bookkeeping ``sync_engines`` does
    (``"connect"`` = an engine restart: ``weight_sync_step.connect``'s reset)."""
    out = []
    for v in versions:
        if v == "connect":
            run.synced_once, run.verified_changed = False, False
            continue
        out.append((v, verifies(run, v)))
        run.synced_once, run.synced_version = True, v
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

