"""Advantage estimators against per-group formulas written with Python's statistics module."""

from __future__ import annotations

import statistics

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages
from megarl.algorithms.advantages import GRPO_EPS

pytestmark = pytest.mark.timeout(60)


def _reference(name: str, rewards: list[float], group_ids: list[int], eps: float = GRPO_EPS) -> list[float]:
    groups: dict[int, list[float]] = {}
    for reward, gid in zip(rewards, group_ids):
        groups.setdefault(gid, []).append(reward)
    out = []
    for reward, gid in zip(rewards, group_ids):
        group = groups[gid]
        mean = statistics.fmean(group)
        if name == "grpo":
            std = statistics.stdev(group) if len(group) > 1 else 0.0
            out.append((reward - mean) / (std + eps))
        elif name == "dr_grpo":
            out.append(reward - mean)
        elif name == "rloo":
            others = [r for r in group]
            others.remove(reward)
            out.append(reward - statistics.fmean(others) if others else 0.0)
        elif name == "reinforce_pp":
            out.append(reward - mean)
    if name == "reinforce_pp":
        batch_mean, batch_std = statistics.fmean(out), statistics.stdev(out)
        out = [(a - batch_mean) / (batch_std + eps) for a in out]
    return out


def _ragged(seed: int):
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([7, 3, 7, 9, 3, 7, 9, 9, 9, 42, 3, 3])  # sizes 3, 4, 4, 1; interleaved
    rewards = torch.randint(0, 3, (group_ids.numel(),), generator=gen).to(torch.float64)
    rewards += 0.1 * torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    return rewards, group_ids


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_estimators_match_reference_on_ragged_groups(name):
    rewards, group_ids = _ragged(0)
    advantages = compute_advantages(name, rewards, group_ids)
    expected = _reference(name, rewards.tolist(), group_ids.tolist())
    assert advantages.shape == rewards.shape and advantages.dtype == torch.float64
    assert advantages.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_grid_layout_equals_group_id_layout(name):
    gen = torch.Generator().manual_seed(1)
    grid = torch.rand(4, 5, generator=gen, dtype=torch.float64)
    flat_ids = torch.arange(4).repeat_interleave(5)
    from_grid = compute_advantages(name, grid)
    from_ids = compute_advantages(name, grid.reshape(-1), flat_ids)
    assert from_grid.shape == (4, 5)
    assert torch.allclose(from_grid.reshape(-1), from_ids, rtol=0, atol=1e-14)


def test_grpo_constant_group_and_singleton_give_zero():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    advantages = compute_advantages("grpo", rewards)
    assert torch.equal(advantages[0], torch.zeros(3))
    assert compute_advantages("grpo", torch.tensor([[0.7]])).item() == 0.0
    assert compute_advantages("rloo", torch.tensor([[0.7]])).item() == 0.0


def test_integer_rewards_and_eps_keyword():
    advantages = compute_advantages("grpo", torch.tensor([[1, 0]]), eps=0.0)
    assert advantages.dtype == torch.get_default_dtype()
    std = statistics.stdev([1.0, 0.0])
    assert advantages[0].tolist() == pytest.approx([0.5 / std, -0.5 / std])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="algorithm.advantage_estimator"):
        compute_advantages("gae", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
        compute_advantages("grpo", torch.zeros(4))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("grpo", torch.zeros(4), torch.zeros(4))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_estimate_advantages_passes_the_hyperparameters_the_entry_declares(name):
    """``algorithm.advantage_eps`` reaches grpo and reinforce_pp (the formula with that eps) and is
    not passed to the estimators that take none (they would raise a TypeError)."""
    from types import SimpleNamespace

    from megarl.algorithms.advantages import estimate_advantages

    rewards, group_ids = _ragged(3)
    algorithm = SimpleNamespace(advantage_estimator=name, advantage_eps=0.5)
    expected = _reference(name, rewards.tolist(), group_ids.tolist(), eps=0.5)
    assert estimate_advantages(algorithm, rewards, group_ids).tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_estimate_advantages_takes_an_estimator_by_import_path():
    from types import SimpleNamespace

    from megarl.algorithms.advantages import estimate_advantages

    rewards = torch.tensor([[1.0, 0.0, 0.5]])
    algorithm = SimpleNamespace(advantage_estimator=f"{__name__}:_centred", advantage_eps=0.5)
    assert estimate_advantages(algorithm, rewards).tolist() == [[0.5, -0.5, 0.0]]


def _centred(rewards, group_ids):
    """A user's estimator named by import path: rewards minus 0.5."""
    return rewards - 0.5
