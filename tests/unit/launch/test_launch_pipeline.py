"""The async pipeline: how far generation runs ahead, when engines are synced, staleness bounds.

The driver loop (`megarl.launch.driver.run_loop`) runs for real here on the real rollout, advantage,
train and evaluation stages, with a scripted rollout actor (each rollout is stamped with the engine
weight version at its start, what the engines report), trainer (counts) and weight sync (records).
The reference is the staleness definition in `megarl.launch.pipeline`: version trained minus the
version that generated the oldest trained token, on every token.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megarl.cluster.colocated import EngineMemoryLoan
from megarl.config.loader import load_config
from megarl.data.sampler import ResumableSampler
from megarl.launch import driver
from megarl.launch.advantage_stage import AdvantageStage
from megarl.launch.eval_stage import EvalStage
from megarl.launch.pipeline import pipeline_depth, staleness_bound, sync_due
from megarl.launch.rollout_stage import RolloutStage
from megarl.launch.stages import Stages
from megarl.launch.train_stage import TrainStage
from megarl.rollout.manager import RolloutBatch
from megarl.rollout.types import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.timeout(60)


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class ScriptedActor:
    """The rollout actor's ``generate``: 2 groups of 2, tokens stamped with the engines' version at
    the start; records ``(step, engine version, trainer version)`` of each rollout started."""

    def __init__(self):
        self.started, self._ids, self.train = [], itertools.count(), None
        self.generate = _Remote(self._generate)

    def _generate(self, rows, step, version):
        self.started.append((step, version, self.train.policy_version))
        return RolloutBatch(groups=[TrajectoryGroup(group_id=next(self._ids), trajectories=[
            self._traj(r, version) for r in (0.0, 1.0)]) for _ in range(2)], metrics={})

    @staticmethod
    def _traj(reward, version):
        n = 3
        return Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.arange(n) + 10,
                          loss_mask=torch.ones(n, dtype=torch.int64), rollout_logprobs=torch.full((n,), -0.5),
                          reward=reward, policy_version=version,
                          token_policy_versions=torch.full((n,), version, dtype=torch.int32))


class ScriptedTrainer:
    """One data-parallel rank that trains on anything."""

    dp_size, cp_size = 1, 1

    def prepare(self, shards):
        assert len(shards) == 1
        return {}

    def train_step(self, mini):
        return {"loss/policy": 0.0}


class RecordingSync:
    """The weight sync's face to the loop: records the versions pushed."""

    def __init__(self, every, version=0):
        self.every_n_steps, self.synced_version, self.engine_weight_version = every, version, float(version)
        self.pushed = []

    def push(self, version):
        self.pushed.append(version)
        self.synced_version = version
        return {}


class RecordingCheckpoint:
    """Records the rollouts in flight at each save (the real stage saves them with the driver state)."""

    def __init__(self, rollout):
        self.rollout, self.saved, self.saved_step = rollout, [], None

    def after_step(self, step):
        pass

    def finish(self, step):
        self.saved.append([p.step for p in self.rollout.in_flight])


class RecordingLog:
    def __init__(self):
        self.logged = []

    def step(self, step, metrics, groups, *, policy_version, engine_weight_version):
        self.logged.append(dict(metrics))
        return self.logged[-1]

    def close(self):
        pass


def _stages(cfg, *, first_step=0, policy_version=0):
    ro, every, steps = cfg.rollout, int(cfg.weight_sync.every_n_steps), int(cfg.train.num_steps)
    actor, sync = ScriptedActor(), RecordingSync(every, policy_version)
    rollout = RolloutStage(ro, [{"prompt": str(i)} for i in range(64)], ResumableSampler(64, seed=0), actor,
                           num_steps=steps, depth=pipeline_depth(ro.async_mode, ro.max_staleness, every), sync=sync,
                           heal=lambda version: [])
    train = actor.train = TrainStage(ScriptedTrainer(), EngineMemoryLoan(lends=False, weights_each_step=True),
                                     global_batch_size=cfg.train.global_batch_size, policy_version=policy_version)
    stages = Stages(rollout, AdvantageStage(cfg.algorithm, staleness_bound(ro.async_mode, ro.max_staleness, every)),
                    train, sync, EvalStage(None, None, interval=0, num_steps=steps), RecordingCheckpoint(rollout),
                    RecordingLog(), num_steps=steps, first_step=first_step)
    return stages, actor


def _cfg(async_mode, max_staleness, every, steps=7):
    return load_config(None, [f"rollout.async_mode={str(async_mode).lower()}", f"rollout.max_staleness={max_staleness}",
                              f"weight_sync.every_n_steps={every}", f"train.num_steps={steps}",
                              "data.eval_interval=0", "checkpoint.save_interval=0", "logging.progress_bar=false"])


@pytest.mark.parametrize("async_mode,max_staleness,every", [
    (False, 0, 1), (False, 1, 2), (True, 1, 1), (True, 2, 1), (True, 4, 1), (True, 2, 2), (True, 3, 2)])
def test_every_trained_token_is_within_the_bound_and_the_pipeline_is_as_deep_as_allowed(
        async_mode, max_staleness, every):
    cfg = _cfg(async_mode, max_staleness, every)
    stages, actor = _stages(cfg)
    driver.run_loop(stages)
    depth = pipeline_depth(async_mode, max_staleness, every)
    steps = cfg.train.num_steps
    # every step's rollout started exactly once, in step order
    assert [s for s, _, _ in actor.started] == list(range(steps))
    # the rollout of step s starts once step s - depth's rollout was taken: trainer at version s - depth
    for step, engine_version, trainer_version in actor.started:
        assert trainer_version == max(0, step - depth)
        assert engine_version <= trainer_version and trainer_version - engine_version <= every - 1
    # weights pushed every `every` versions and after the last step
    assert stages.sync.pushed == [v for v in range(1, steps + 1) if v % every == 0 or v == steps]
    staleness = [m["filter/trained_staleness_max"] for m in stages.log.logged]
    assert max(staleness) <= (max_staleness if async_mode or every > 1 else 0)
    if depth:  # the bound is reached: the pipeline is not shallower than it may be
        assert max(staleness) == max_staleness
    assert all(m["filter/dropped_stale"] == 0 for m in stages.log.logged)
    assert stages.checkpoint.saved == [[]]  # the final checkpoint: nothing left in flight


def test_pipeline_arithmetic_and_validation():
    assert pipeline_depth(False, 5, 1) == 0
    assert pipeline_depth(True, 2, 1) == 2 and pipeline_depth(True, 4, 2) == 3
    with pytest.raises(ValueError, match="every_n_steps=3"):
        pipeline_depth(True, 2, 3)
    assert staleness_bound(False, 1, 1) is None and staleness_bound(False, 2, 3) == 2
    assert sync_due(4, 2, last_step=False, eval_next=False) and not sync_due(3, 2, last_step=False, eval_next=False)
    assert sync_due(3, 2, last_step=True, eval_next=False) and sync_due(3, 2, last_step=False, eval_next=True)

    from megarl.config.validate import validate

    def problems(*overrides):
        cfg = load_config("configs/cpu_gsm8k.yaml", list(overrides))
        try:
            validate(cfg)
        except Exception as e:  # noqa: BLE001 - the aggregated validation error
            return str(e)
        return ""

    assert "rollout.max_staleness" in problems("rollout.async_mode=true", "rollout.max_staleness=1",
                                               "weight_sync.every_n_steps=2")
    assert "rollout.max_staleness" in problems("weight_sync.every_n_steps=3", "rollout.max_staleness=1")


def test_resume_restores_every_rollout_in_flight_and_starts_no_extra_one():
    cfg = _cfg(True, 3, 1, steps=6)
    before, _ = _stages(cfg, first_step=2, policy_version=2)  # the run that saved the checkpoint
    saved = [before.rollout.start(s) for s in (2, 3, 4)]  # in flight when it was saved
    pending = [{"step": p.step, "rows": p.rows, "groups": p.wait().groups, "metrics": {},
                "policy_version": p.policy_version} for p in saved]
    stages, actor = _stages(cfg, first_step=2, policy_version=2)
    stages.rollout.restore(before.rollout.sampler.state_dict(), pending)
    driver.run_loop(stages)
    assert [s for s, _, _ in actor.started] == [5]  # 2..4 came from the checkpoint
    assert [p["step"] for p in pending] == [2, 3, 4] and stages.sync.pushed == [3, 4, 5, 6]
