"""Driver checkpoint layout: atomic `latest`, keep_last pruning, RNG restore."""
import random

import numpy as np
import pytest
import torch

from megarl.launch.run_state import (
    RunState,
    capture_rng,
    commit_checkpoint,
    find_latest,
    load_driver_state,
    restore_rng,
    save_driver_state,
    step_dir,
)


def test_rng_restore_reproduces_the_next_draws():
    torch.manual_seed(0)
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def test_save_commit_and_find_latest(tmp_path):
    assert find_latest(tmp_path) is None
    for step in (2, 4, 6):
        d = step_dir(tmp_path, step)
        save_driver_state(d, RunState(step=step, policy_version=step, sampler={"epoch": 0, "position": step}),
                          "train:\n  seed: 1\n")
        commit_checkpoint(tmp_path, d, keep_last=2)
    latest = find_latest(tmp_path)
    assert latest == step_dir(tmp_path, 6)
    state = load_driver_state(latest)
    assert state.step == 6 and state.sampler["position"] == 6
    assert (latest / "config.yaml").read_text().startswith("train:")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000004", "step_000006"]


def test_a_checkpoint_interrupted_before_commit_is_not_used(tmp_path):
    d = step_dir(tmp_path, 1)
    save_driver_state(d, RunState(step=1), "")
    commit_checkpoint(tmp_path, d, keep_last=0)
    (step_dir(tmp_path, 2) / "trainer").mkdir(parents=True)  # killed while the trainer was saving
    assert find_latest(tmp_path) == d
    (tmp_path / "latest").write_text("step_000002")
    with pytest.raises(FileNotFoundError, match="driver_state"):
        find_latest(tmp_path)


def test_in_flight_rollouts_come_back_as_trajectory_groups(tmp_path):
    """Async checkpoints hold the rollouts in flight; a resumed driver sorts them by group_id."""
    import torch

    from megarl.rollout.types import Trajectory, TrajectoryGroup

    traj = Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3]),
                      loss_mask=torch.tensor([1]), rollout_logprobs=torch.tensor([-0.5]), reward=1.0)
    pending = [{"step": 3, "rows": [{"question": "q"}], "groups": [TrajectoryGroup(group_id=7, trajectories=[traj])],
                "metrics": {"rollout/reward_mean": 1.0}, "policy_version": 2}]
    d = step_dir(tmp_path, 2)
    save_driver_state(d, RunState(step=2, policy_version=2, pending_rollouts=pending), "")
    (group,) = load_driver_state(d).pending_rollouts[0]["groups"]
    assert isinstance(group, TrajectoryGroup) and group.group_id == 7
    assert torch.equal(group.trajectories[0].response_ids, traj.response_ids)
