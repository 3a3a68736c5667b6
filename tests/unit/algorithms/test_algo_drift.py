"""Staleness by measured drift (`megarl.algorithms.drift`, issue 28 part 2) against a reference
written from the formulas with Python floats, plus the trainer-side path (`forward.loss_inputs`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarl.algorithms import DRIFT_STATISTICS, behaviour_drift, drift_filter, reduce_metrics
from megarl.config.schema import AlgorithmConfig
from megarl.training import forward as fwd
from megarl.training.batch import TrainBatch

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[3]


def _reference_drift(old, rollout, mask, statistic):
    """D_i from the module docstring, token by token in Python floats (no megarl code)."""
    out = []
    for i in range(old.shape[0]):
        d = [float(old[i, t]) - float(rollout[i, t]) for t in range(old.shape[1]) if mask[i, t]]
        if not d:
            out.append(0.0)
        elif statistic == "k3_mean":
            out.append(sum(math.exp(x) - 1 - x for x in d) / len(d))
        elif statistic == "log_ratio_abs_mean":
            out.append(sum(abs(x) for x in d) / len(d))
        else:
            out.append(max(abs(x) for x in d))
    return out


def _fixture(seed=0, shape=(6, 9)):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(shape, generator=gen) * 3
    scale = torch.tensor([0.01, 0.05, 0.3, 0.8, 0.02, 1.5])[: shape[0], None]  # fresh ... very stale
    old = rollout + scale * torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) > 0.3
    mask[:, 0] = False
    mask[4] = False  # a trajectory without loss tokens: never dropped, never counted
    # garbage outside the mask must not matter
    old = torch.where(mask, old, torch.full_like(old, 50.0))
    return old, rollout, mask


@pytest.mark.parametrize("statistic", DRIFT_STATISTICS)
def test_drift_matches_the_hand_computed_formula(statistic):
    old, rollout, mask = _fixture()
    drift = behaviour_drift(old, rollout, mask, statistic=statistic)
    assert drift.dtype == torch.float64 and drift.shape == (6,)
    ref = _reference_drift(old, rollout, mask, statistic)
    for got, want in zip(drift.tolist(), ref):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert drift[4] == 0 and (drift >= 0).all()


@pytest.mark.parametrize("statistic", DRIFT_STATISTICS)
def test_trajectories_over_the_bound_are_dropped_whole_and_metrics_match(statistic):
    old, rollout, mask = _fixture()
    ref = _reference_drift(old, rollout, mask, statistic)
    bound = sorted(ref)[3] * 0.999 + sorted(ref)[4] * 0.001  # between two trajectories' drifts
    result = drift_filter(old, rollout, mask, max_drift=bound, statistic=statistic)
    has_tokens = [bool(mask[i].any()) for i in range(6)]
    dropped = [has_tokens[i] and ref[i] > bound for i in range(6)]
    assert 0 < sum(dropped) < sum(has_tokens), "the fixture should drop some trajectories, not all"
    assert result.dropped.tolist() == dropped
    for i in range(6):
        expected_row = torch.zeros_like(mask[i]) if dropped[i] else mask[i]
        assert torch.equal(result.loss_mask[i], expected_row)
    m = result.metrics
    kept_seqs = [i for i in range(6) if has_tokens[i]]
    assert float(m["filter/dropped_drift_frac"].value) == pytest.approx(sum(dropped) / len(kept_seqs))
    assert float(m["filter/dropped_drift_frac"].weight) == len(kept_seqs)
    dropped_tokens = sum(int(mask[i].sum()) for i in range(6) if dropped[i])
    assert float(m["filter/dropped_drift_token_frac"].value) == pytest.approx(dropped_tokens / int(mask.sum()))
    assert float(m["mismatch/behaviour_drift_mean"].value) == pytest.approx(
        sum(ref[i] for i in kept_seqs) / len(kept_seqs), rel=1e-9)
    assert float(m["mismatch/behaviour_drift_max"].value) == pytest.approx(max(ref), rel=1e-9)


def test_a_trajectory_exactly_at_the_bound_is_kept():
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -1.5, -2.25], [0.0, -1.5, -2.0]])  # max |d|: 0.5 and 0.5 (exact in binary)
    mask = torch.tensor([[False, True, True], [False, True, True]])
    kept = drift_filter(old, rollout, mask, max_drift=0.5, statistic="log_ratio_abs_max")
    assert not kept.dropped.any() and torch.equal(kept.loss_mask, mask)
    over = drift_filter(old, rollout, mask, max_drift=0.4999, statistic="log_ratio_abs_max")
    assert over.dropped.all() and not over.loss_mask.any()


def test_the_decision_depends_on_nothing_but_the_trajectory():
    """Resume safety: a fresh call on the same batch gives identical bits, and a trajectory's drift
    and decision are the same bits whatever batch-mates, padding width or row order surround it
    (another step's batch, another data-parallel layout, a restarted trainer)."""
    old, rollout, mask = _fixture(seed=1)
    first = drift_filter(old, rollout, mask, max_drift=0.05)
    again = drift_filter(old.clone(), rollout.clone(), mask.clone(), max_drift=0.05)
    assert torch.equal(first.drift, again.drift) and torch.equal(first.loss_mask, again.loss_mask)
    assert torch.equal(first.dropped, again.dropped)

    o2, r2, m2 = _fixture(seed=7, shape=(6, 40))  # other trajectories, a wider padding
    o2, r2, m2 = torch.cat([o2, o2]), torch.cat([r2, r2]), torch.cat([m2, m2])
    rows = [9, 2, 11, 5, 0, 7]  # where trajectory i lands among the others
    for i, row in enumerate(rows):
        o2[row], r2[row], m2[row] = 0.0, 0.0, False
        o2[row, : old.shape[1]], r2[row, : old.shape[1]], m2[row, : old.shape[1]] = old[i], rollout[i], mask[i]
    other = drift_filter(o2, r2, m2, max_drift=0.05)
    for i, row in enumerate(rows):
        assert other.drift[row].item() == first.drift[i].item()  # bitwise, not approx
        assert bool(other.dropped[row]) == bool(first.dropped[i])
    assert first.dropped.any() and not first.dropped.all()


def test_metrics_over_two_shards_reduce_to_the_whole_batch_metrics():
    """What the data-parallel all-reduce computes (`reduce_metrics` is its reference)."""
    old, rollout, mask = _fixture(seed=2)
    whole = drift_filter(old, rollout, mask, max_drift=0.02).metrics
    parts = [drift_filter(old[s], rollout[s], mask[s], max_drift=0.02).metrics for s in (slice(0, 2), slice(2, 6))]
    combined = reduce_metrics(parts)
    assert set(combined) == set(whole)
    for name in whole:
        assert float(combined[name].value) == pytest.approx(float(whole[name].value), rel=1e-12), name


def test_bad_bounds_and_statistics_are_refused():
    old, rollout, mask = _fixture()
    for bound in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_behaviour_drift"):
            drift_filter(old, rollout, mask, max_drift=bound)
    with pytest.raises(ValueError, match="statistic"):
        drift_filter(old, rollout, mask, max_drift=1.0, statistic="k2_sum")
    with pytest.raises(ValueError, match="shape"):
        behaviour_drift(old, rollout[:, :3], mask)


# ---------------------------------------------------------------- trainer side: forward.loss_inputs
def _packed_batch():
    lengths = [4, 6, 5, 3]
    cu = torch.tensor([0, 4, 10, 15, 18])
    mask = torch.ones(18, dtype=torch.bool)
    mask[cu[:-1]] = False
    rollout = torch.linspace(-2.0, -0.3, 18)
    shift = torch.zeros(18)
    shift[4:10] = torch.tensor([0.0, 0.9, -0.8, 1.1, 0.7, -1.0])  # trajectory 1: far from pi_old
    shift[15:18] = torch.tensor([0.0, 0.01, -0.02])                # trajectory 3: close
    shift[1:4] = torch.tensor([0.05, -0.03, 0.02])
    shift[11:15] = torch.tensor([0.4, -0.5, 0.3, 0.6])             # trajectory 2: in between
    batch = TrainBatch(input_ids=torch.arange(1, 19), cu_seqlens=cu, loss_mask=mask,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), rollout_logprobs=rollout,
                       old_logprobs=rollout + shift)
    return batch, max(lengths)


def _same_inputs(a, b):
    assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.old_logprobs, b.old_logprobs)
    assert torch.equal(a.advantages, b.advantages)
    assert (a.is_weights is None) == (b.is_weights is None)
    if a.is_weights is not None:
        assert torch.equal(a.is_weights, b.is_weights)
    assert torch.equal(torch.as_tensor(a.normalizer.num_tokens), torch.as_tensor(b.normalizer.num_tokens))
    assert torch.equal(torch.as_tensor(a.normalizer.num_seqs), torch.as_tensor(b.normalizer.num_seqs))


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_the_disabled_default_changes_nothing(correction):
    assert AlgorithmConfig().max_behaviour_drift is None
    batch, lmax = _packed_batch()
    off, off_metrics = fwd.loss_inputs(batch, AlgorithmConfig(rollout_correction=correction), device="cpu",
                                       max_response_tokens=lmax)
    if correction == "none":  # exactly the batch's own mask and counts, no weights, no metrics
        assert off.loss_mask is batch.loss_mask and off.is_weights is None and off_metrics == {}
        assert float(off.normalizer.num_tokens) == 14 and float(off.normalizer.num_seqs) == 4
    assert not any(k.startswith("filter/") or "behaviour_drift" in k for k in off_metrics)
    # a bound nothing exceeds: the same loss inputs, bit for bit (only the filter's metrics added)
    huge, huge_metrics = fwd.loss_inputs(batch, AlgorithmConfig(rollout_correction=correction, max_behaviour_drift=1e9),
                                         device="cpu", max_response_tokens=lmax)
    _same_inputs(off, huge)
    assert float(huge_metrics["filter/dropped_drift_frac"].value) == 0.0
    for name, metric in off_metrics.items():
        assert torch.equal(metric.value, huge_metrics[name].value), name


def test_loss_inputs_drops_the_drifted_trajectories_before_counting_and_correcting():
    batch, lmax = _packed_batch()
    cu = batch.cu_seqlens.tolist()
    drifts = []
    for i in range(4):
        d = [float(batch.old_logprobs[t] - batch.rollout_logprobs[t]) for t in range(cu[i], cu[i + 1])
             if batch.loss_mask[t]]
        drifts.append(sum(math.exp(x) - 1 - x for x in d) / len(d))
    bound = 0.05
    dropped = [d > bound for d in drifts]
    assert dropped == [False, True, True, False], drifts
    algo = AlgorithmConfig(policy_loss="ppo_clip", max_behaviour_drift=bound, rollout_correction="decoupled",
                           rollout_correction_clip=2.0)
    inputs, metrics = fwd.loss_inputs(batch, algo, device="cpu", max_response_tokens=lmax)
    expected = batch.loss_mask.clone()
    for i in range(4):
        if dropped[i]:
            expected[cu[i]:cu[i + 1]] = False
    weights = torch.exp(batch.old_logprobs - batch.rollout_logprobs)
    expected &= weights <= 2.0  # the correction then runs on the kept trajectories
    assert torch.equal(inputs.loss_mask, expected)
    torch.testing.assert_close(inputs.is_weights, torch.where(expected, weights, 0.0))
    assert float(inputs.normalizer.num_tokens) == expected.sum().item()  # dropped tokens not counted
    assert float(inputs.normalizer.num_seqs) == 2
    assert float(metrics["filter/dropped_drift_frac"].value) == pytest.approx(2 / 4)
    assert float(metrics["filter/dropped_drift_token_frac"].value) == pytest.approx((5 + 4) / 14)
    assert float(metrics["mismatch/behaviour_drift_max"].value) == pytest.approx(max(drifts), rel=1e-9)
    assert "mismatch/is_masked_frac" in metrics


def test_megarl_validate_checks_the_domain_naming_the_key():
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate

    def issues(overrides):
        try:
            validate(load_config(REPO / "configs" / "base.yaml", ["model.hf_path=x", "data.train_path=y", *overrides]),
                     check_paths=False, check_fit=False)
        except ConfigError as err:
            return [str(i) for i in err.issues]
        return []

    for bad in ("0", "-0.1"):
        found = [i for i in issues([f"algorithm.max_behaviour_drift={bad}"]) if "algorithm.max_behaviour_drift" in i]
        assert found and "(0, inf)" in found[0], found
    found = [i for i in issues(["algorithm.behaviour_drift_statistic=k2"]) if "behaviour_drift_statistic" in i]
    assert found and "'k3_mean'" in found[0], found
    for good in ("null", "0.01"):
        assert not [i for i in issues([f"algorithm.max_behaviour_drift={good}"]) if "behaviour_drift" in i]
