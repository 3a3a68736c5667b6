"""Driver stages on hand-made trajectories: filters, group advantages, packing, rollout statistics."""
import statistics
from types import SimpleNamespace

import pytest
import torch

from megarl.launch.advantage_stage import build_train_batch, logprob_mismatch, rollout_metrics
from megarl.rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

ALGO = SimpleNamespace(advantage_estimator="grpo", advantage_eps=1e-6, filter_zero_variance_groups=True)


def traj(reward, *, version=5, status=RolloutStatus.COMPLETED, n=3, tools=0):
    return Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.arange(n) + 10,
                      loss_mask=torch.ones(n, dtype=torch.int64), rollout_logprobs=torch.full((n,), -0.5),
                      reward=reward, status=status, num_turns=2, policy_version=version,
                      metadata={"tool_calls": tools})


def test_filters_and_group_relative_advantages():
    groups = [
        TrajectoryGroup(group_id=0, trajectories=[traj(1.0), traj(0.0), traj(0.0), traj(1.0, status=RolloutStatus.ERROR)]),
        TrajectoryGroup(group_id=1, trajectories=[traj(1.0), traj(1.0)]),                 # zero variance
        TrajectoryGroup(group_id=2, trajectories=[traj(1.0), traj(0.0, version=2), traj(0.5)]),  # one stale
    ]
    out = build_train_batch(groups, algorithm=ALGO, policy_version=5, max_staleness=1)
    assert out.metrics["filter/dropped_failed"] == 1
    assert out.metrics["filter/dropped_zero_variance"] == 2
    assert out.metrics["filter/dropped_stale"] == 1
    assert out.metrics["filter/kept_trajectories"] == 5
    # Reference: (r - mean) / (unbiased std + eps) within each kept group.
    expected = []
    for rewards in ([1.0, 0.0, 0.0], [1.0, 0.5]):
        mu, sd = statistics.mean(rewards), statistics.stdev(rewards)
        expected += [(r - mu) / (sd + 1e-6) for r in rewards]
    assert out.batch.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    assert out.batch.num_sequences == 5 and out.batch.num_tokens == 25
    assert int(out.batch.loss_mask.sum()) == 15


def test_nothing_left_gives_no_batch():
    groups = [TrajectoryGroup(group_id=0, trajectories=[traj(0.0), traj(0.0)])]
    out = build_train_batch(groups, algorithm=ALGO, policy_version=0)
    assert out.batch is None and out.metrics["filter/kept_groups"] == 0


def test_rollout_metrics():
    groups = [TrajectoryGroup(group_id=0, trajectories=[traj(1.0, n=2, tools=1), traj(0.0, n=4, version=3),
                                                        traj(0.0, status=RolloutStatus.TRUNCATED)])]
    m = rollout_metrics(groups, policy_version=5)
    assert m["rollout/reward_mean"] == pytest.approx(1 / 3)
    assert m["rollout/reward_std"] == pytest.approx(statistics.pstdev([1.0, 0.0, 0.0]))
    assert m["rollout/staleness_max"] == 2 and m["rollout/num_trajectories"] == 3


def test_logprob_mismatch_on_trained_tokens():
    groups = [TrajectoryGroup(group_id=0, trajectories=[traj(1.0), traj(0.0)])]
    batch = build_train_batch(groups, algorithm=ALGO, policy_version=5).batch
    old = batch.rollout_logprobs.clone()
    old[batch.loss_mask] += torch.tensor([0.1, -0.3, 0.2, 0.0, 0.1, 0.1])
    old[~batch.loss_mask] = 7.0  # prompt positions must not count
    m = logprob_mismatch(batch.replace(old_logprobs=old))
    assert m["mismatch/log_ratio_abs_mean"] == pytest.approx(0.8 / 6, rel=1e-5)
