"""``Run.heal_engines``: an engine the router took out of service comes back only when it reports the
synced policy version; one that does not answer, or reports another version, is restarted first.

Found by the async arithmetic demo: a dropped connection while the engine was paused for a weight
update took it out of service, nothing brought it back, and 19 steps trained on nothing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.launch import run as run_module
from megarl.launch import weight_sync_step


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class RolloutDouble:
    """The rollout actor's engine bookkeeping: which engines answer, which the router benched, and
    the weight version each reports."""

    def __init__(self, answers: dict[str, bool], benched: set[str], versions: dict[str, str]):
        self.answers, self.benched, self.versions = answers, set(benched), versions
        self.engine_health = _Remote(lambda: dict(self.answers))
        self.out_of_service = _Remote(lambda: sorted(self.benched | {e for e, ok in self.answers.items() if not ok}))
        self.set_alive = _Remote(self._admit)

    def _admit(self, eid: str, version: str) -> bool:
        if self.versions[eid] != version:
            return False
        self.benched.discard(eid)
        return True


def _run(rollout: RolloutDouble, synced_version: int = 7):
    restarted = []

    def restart(index):
        eid = ids[index]
        restarted.append(eid)
        rollout.answers[eid] = True

    def sync_weights(version):
        for eid in rollout.versions:
            rollout.versions[eid] = str(version)

    ids = sorted(rollout.answers)
    return SimpleNamespace(rollout=rollout, synced_version=synced_version, state=SimpleNamespace(policy_version=7),
                           engines=SimpleNamespace(ids=ids, restart=restart, stop_broken=lambda: []),
                           sync_weights=sync_weights), restarted


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(run_module.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(weight_sync_step, "connect", lambda run: None)


def test_a_benched_engine_that_answers_with_the_synced_version_is_readmitted_without_restart():
    rollout = RolloutDouble({"engine0": True, "engine1": True}, benched={"engine1"},
                            versions={"engine0": "7", "engine1": "7"})
    run, restarted = _run(rollout)
    assert run_module.Run.heal_engines(run) == ["engine1"]
    assert restarted == [] and rollout.out_of_service.remote() == []


def test_a_benched_engine_with_other_weights_is_restarted_and_resynced():
    rollout = RolloutDouble({"engine0": True, "engine1": True}, benched={"engine1"},
                            versions={"engine0": "7", "engine1": "5"})
    run, restarted = _run(rollout)
    assert run_module.Run.heal_engines(run) == ["engine1"]
    assert restarted == ["engine1"] and rollout.out_of_service.remote() == []


def test_an_engine_that_does_not_answer_is_restarted_and_nothing_else_happens_when_all_serve():
    rollout = RolloutDouble({"engine0": False, "engine1": True}, benched=set(), versions={"engine0": "0", "engine1": "7"})
    run, restarted = _run(rollout)
    assert run_module.Run.heal_engines(run) == ["engine0"] and restarted == ["engine0"]
    assert run_module.Run.heal_engines(run) == []  # everything serves: nothing to do
