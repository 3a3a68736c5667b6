"""``heal_engines`` (`megarl.cluster.ray_engines`): an engine the router took out of service comes back
only when it reports the synced policy version; one that does not answer, or reports another
version, is restarted first.

Found by the async arithmetic demo: a dropped connection while the engine was paused for a weight
update took it out of service, nothing brought it back, and 19 steps trained on nothing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from megarl.cluster.ray_engines import heal_engines


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


class SyncDouble:
    """The weight sync's ``resync``: every engine then reports the version pushed."""

    def __init__(self, rollout: RolloutDouble, synced_version: int):
        self.rollout, self.synced_version, self.resynced = rollout, synced_version, []

    def resync(self, version: int) -> int:
        self.resynced.append(version)
        for eid in self.rollout.versions:
            self.rollout.versions[eid] = str(version)
        self.synced_version = version
        return version


def _heal(rollout: RolloutDouble, synced_version: int = 7):
    """``heal()`` (the trainer at policy version 7) and the engines restarted."""
    restarted = []

    def restart(index):
        eid = ids[index]
        restarted.append(eid)
        rollout.answers[eid] = True

    ids = sorted(rollout.answers)
    engines = SimpleNamespace(ids=ids, restart=restart, stop_broken=lambda: [])
    sync = SyncDouble(rollout, synced_version)
    return (lambda: heal_engines(engines, rollout, sync, 7)), restarted


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)


def test_a_benched_engine_that_answers_with_the_synced_version_is_readmitted_without_restart():
    rollout = RolloutDouble({"engine0": True, "engine1": True}, benched={"engine1"},
                            versions={"engine0": "7", "engine1": "7"})
    heal, restarted = _heal(rollout)
    assert heal() == ["engine1"]
    assert restarted == [] and rollout.out_of_service.remote() == []


def test_a_benched_engine_with_other_weights_is_restarted_and_resynced():
    rollout = RolloutDouble({"engine0": True, "engine1": True}, benched={"engine1"},
                            versions={"engine0": "7", "engine1": "5"})
    heal, restarted = _heal(rollout)
    assert heal() == ["engine1"]
    assert restarted == ["engine1"] and rollout.out_of_service.remote() == []


def test_an_engine_that_does_not_answer_is_restarted_and_nothing_else_happens_when_all_serve():
    rollout = RolloutDouble({"engine0": False, "engine1": True}, benched=set(), versions={"engine0": "0", "engine1": "7"})
    heal, restarted = _heal(rollout)
    assert heal() == ["engine0"] and restarted == ["engine0"]
    assert heal() == []  # everything serves: nothing to do
