"""Rollout corrections (TIS, MIS, IcePop) and mismatch metrics against per-token formulas."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import ROLLOUT_CORRECTIONS, gspo_loss, icepop, masked_is, ppo_clip_loss, truncated_is
from megarl.algorithms.aggregation import LossNormalizer

pytestmark = pytest.mark.timeout(60)


def _batch(seed: int = 0, noise: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    rollout = old + noise * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 6, generator=gen) > 0.3
    mask[:, 0] = True
    mask[2] = False
    rollout = torch.where(mask, rollout, torch.full_like(rollout, math.nan))  # engine padding
    return old, rollout, mask


def _tokens(mask):
    return [tuple(ix) for ix in mask.nonzero().tolist()]


def test_token_tis_weights_and_metrics():
    old, rollout, mask = _batch()
    result = truncated_is(old, rollout, mask, upper=2.0)
    clipped, abs_diffs = 0, []
    for i, t in _tokens(mask):
        w = math.exp(old[i, t] - rollout[i, t])
        assert result.weights[i, t].item() == pytest.approx(min(w, 2.0), rel=1e-12)
        clipped += w > 2.0
        abs_diffs.append(abs(float(old[i, t] - rollout[i, t])))
    assert torch.equal(result.loss_mask, mask)
    assert (result.weights[~mask] == 0).all()
    n = len(abs_diffs)
    m = result.metrics
    assert 0 < clipped < n
    assert m["mismatch/is_clip_frac"].value.item() == pytest.approx(clipped / n)
    assert m["mismatch/log_ratio_abs_mean"].value.item() == pytest.approx(sum(abs_diffs) / n, rel=1e-12)
    prob_err = sum(math.exp(d) for d in abs_diffs) / n
    assert m["mismatch/token_prob_ratio_error"].value.item() == pytest.approx(prob_err, rel=1e-12)
    assert m["mismatch/is_weight_max"].value.item() <= 2.0


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_level_tis(level):
    old, rollout, mask = _batch(1, noise=0.3)
    result = truncated_is(old, rollout, mask, level=level, upper=1.5, lower=0.7)
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        if not idx:
            assert (result.weights[i] == 0).all()
            continue
        log_w = sum(float(old[i, t] - rollout[i, t]) for t in idx)
        if level == "geometric":
            log_w /= len(idx)
        expected = min(max(math.exp(log_w), 0.7), 1.5)
        assert result.weights[i, idx].tolist() == pytest.approx([expected] * len(idx), rel=1e-12)
    assert result.metrics["mismatch/is_clip_frac"].weight.item() == mask.any(-1).sum().item()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_is_drops_outside_band(level):
    old, rollout, mask = _batch(2, noise=0.5)
    result = masked_is(old, rollout, mask, level=level, lower=0.6, upper=1.8)
    dropped = 0
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        seq_w = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in idx))
        for t in idx:
            w = math.exp(float(old[i, t] - rollout[i, t])) if level == "token" else seq_w
            inside = 0.6 <= w <= 1.8
            assert bool(result.loss_mask[i, t]) == inside
            assert result.weights[i, t].item() == pytest.approx(w if inside else 0.0, rel=1e-12)
            dropped += (not inside) if level == "token" else 0
        dropped += (level != "token") and bool(idx) and not (0.6 <= seq_w <= 1.8)
    items = int(mask.sum()) if level == "token" else int(mask.any(-1).sum())
    assert 0 < dropped < items
    assert result.metrics["mismatch/is_masked_frac"].value.item() == pytest.approx(dropped / items)
    assert not (result.loss_mask & ~mask).any()


def test_icepop_is_token_masking_with_its_band():
    old, rollout, mask = _batch(3, noise=1.0)
    result = icepop(old, rollout, mask)
    w = torch.exp(old - rollout)
    expected_mask = mask & (w >= 0.5) & (w <= 5.0)
    assert torch.equal(result.loss_mask, expected_mask)
    assert torch.allclose(result.weights[expected_mask], w[expected_mask], rtol=1e-12, atol=0)
    assert set(ROLLOUT_CORRECTIONS) == {"tis", "mis", "icepop", "decoupled"}


def test_correction_feeds_policy_losses_without_nan():
    """Weights multiply token losses; dropped tokens leave the loss and the denominators."""
    old, rollout, mask = _batch(4, noise=0.8)
    logprobs = (old + 0.01).requires_grad_()
    correction = masked_is(old, rollout, mask)
    normalizer = LossNormalizer.from_loss_mask(correction.loss_mask)
    adv = torch.ones(5, dtype=torch.float64)
    loss, _ = ppo_clip_loss(
        logprobs, old, adv, correction.loss_mask, is_weights=correction.weights, normalizer=normalizer
    )
    loss.backward()
    expected = -(correction.weights * torch.exp(torch.tensor(0.01, dtype=torch.float64).clamp(max=0.2))).sum()
    assert loss.item() == pytest.approx(expected.item() / correction.loss_mask.sum().item(), rel=1e-12)
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~correction.loss_mask] == 0).all()
    gspo, _ = gspo_loss(logprobs, old, adv, correction.loss_mask, is_weights=correction.weights)
    assert torch.isfinite(gspo)


def test_bad_arguments():
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="correction level"):
        truncated_is(old, rollout, mask, level="turn")
    with pytest.raises(ValueError, match="lower <= upper"):
        masked_is(old, rollout, mask, lower=2.0, upper=1.0)
    with pytest.raises(ValueError, match="rollout_logprobs shape"):
        icepop(old, rollout[:, :3], mask)
