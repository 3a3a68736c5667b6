"""The async pipeline: how far generation runs ahead, when engines are synced, staleness bounds.

The driver loop (`megarl.launch.driver.run_loop`) runs for real here against a scripted run: each
rollout is stamped with the engine weight version at its start (what the engines report), the
trainer and sync only count. The reference is the staleness definition in `megarl.launch.pipeline`:
version trained minus the version that generated the oldest trained token, on every token.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megarl.config.loader import load_config
from megarl.launch import driver
from megarl.launch.pipeline import pipeline_depth, staleness_bound, sync_due
from megarl.launch.run import PendingRollout
from megarl.launch.run_state import RunState
from megarl.rollout.manager import RolloutBatch
from megarl.rollout.types import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.timeout(60)


class ScriptedRun:
    """The operations `run_loop` calls, recording the schedule (no processes)."""

    def __init__(self, cfg):
        self.cfg, self.state = cfg, RunState()
        self.synced_version, self.engine_weight_version = 0, 0.0
        self.started, self.syncs, self.saved, self.logged = [], [], [], []
        self._ids = itertools.count()
        self.trainer = self
        self.metrics = self

    # rollouts: 2 groups of 2, tokens stamped with the engines' version at the start
    def start_rollout(self, step, rows=None):
        version = self.synced_version
        self.started.append((step, version, self.state.policy_version))
        groups = [TrajectoryGroup(group_id=next(self._ids), trajectories=[self._traj(r, version) for r in (0.0, 1.0)])
                  for _ in range(2)]
        return PendingRollout(step, rows or [], RolloutBatch(groups=groups, metrics={}), version)

    @staticmethod
    def _traj(reward, version):
        n = 3
        return Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.arange(n) + 10,
                          loss_mask=torch.ones(n, dtype=torch.int64), rollout_logprobs=torch.full((n,), -0.5),
                          reward=reward, policy_version=version,
                          token_policy_versions=torch.full((n,), version, dtype=torch.int32))

    # trainer: one data-parallel rank
    dp_size, cp_size = 1, 1

    def prepare(self, shards):
        assert len(shards) == 1
        return {}

    def train_step(self, mini):
        return {"loss/policy": 0.0}

    def sync_weights(self, version):
        self.syncs.append(version)
        self.synced_version = version
        return {}

    def heal_engines(self):
        return []

    def release_engine_memory(self):
        pass

    def resume_engine_memory(self):
        pass

    def evaluate(self):
        return {}

    def save_checkpoint(self, pending=()):
        self.saved.append([p.step for p in pending])

    def log(self, step, metrics):
        self.logged.append(dict(metrics))
        return dict(metrics)


def _cfg(async_mode, max_staleness, every, steps=7):
    return load_config(None, [f"rollout.async_mode={str(async_mode).lower()}", f"rollout.max_staleness={max_staleness}",
                              f"weight_sync.every_n_steps={every}", f"train.num_steps={steps}",
                              "data.eval_interval=0", "checkpoint.save_interval=0", "logging.progress_bar=false"])


@pytest.mark.parametrize("async_mode,max_staleness,every", [
    (False, 0, 1), (False, 1, 2), (True, 1, 1), (True, 2, 1), (True, 4, 1), (True, 2, 2), (True, 3, 2)])
def test_every_trained_token_is_within_the_bound_and_the_pipeline_is_as_deep_as_allowed(
        async_mode, max_staleness, every):
    run = ScriptedRun(_cfg(async_mode, max_staleness, every))
    driver.run_loop(run)
    depth = pipeline_depth(async_mode, max_staleness, every)
    steps = run.cfg.train.num_steps
    # every step's rollout started exactly once, in step order
    assert [s for s, _, _ in run.started] == list(range(steps))
    # the rollout of step s starts once step s - depth's rollout was taken: trainer at version s - depth
    for step, engine_version, trainer_version in run.started:
        assert trainer_version == max(0, step - depth)
        assert engine_version <= trainer_version and trainer_version - engine_version <= every - 1
    # weights pushed every `every` versions and after the last step
    assert run.syncs == [v for v in range(1, steps + 1) if v % every == 0 or v == steps]
    staleness = [m["filter/trained_staleness_max"] for m in run.logged]
    assert max(staleness) <= (max_staleness if async_mode or every > 1 else 0)
    if depth:  # the bound is reached: the pipeline is not shallower than it may be
        assert max(staleness) == max_staleness
    assert all(m["filter/dropped_stale"] == 0 for m in run.logged)
    assert run.saved == [[]]  # the final checkpoint: nothing left in flight


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
    run = ScriptedRun(cfg)
    run.state.step = run.state.policy_version = 2
    run.synced_version = 2
    saved = [run.start_rollout(s) for s in (2, 3, 4)]
    run.started.clear()
    run.state.pending_rollouts = [{"step": p.step, "rows": [], "groups": p.result.groups, "metrics": {},
                                   "policy_version": p.policy_version} for p in saved]
    driver.run_loop(run)
    assert [s for s, _, _ in run.started] == [5]  # 2..4 came from the checkpoint
