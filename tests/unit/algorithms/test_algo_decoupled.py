"""Decoupled PPO (AReaL, arXiv:2505.24298 eq. 5) against a direct implementation of the formula."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import decoupled_ppo, ppo_clip_loss
from megarl.config.schema import AlgorithmConfig
from megarl.training import forward as fwd
from megarl.training.batch import TrainBatch

pytestmark = pytest.mark.timeout(60)


def _areal_reference(logprobs, prox, behav, adv, mask, eps, cap):
    """eq. 5 written from the three policies, token mean over kept tokens (no megarl code)."""
    total, count = 0.0, 0
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if not mask[i, t]:
                continue
            behav_weight = torch.exp(prox[i, t] - behav[i, t])
            if cap is not None and behav_weight > cap:
                continue  # AReaL drops tokens over behav_imp_weight_cap
            theta_over_behav = torch.exp(logprobs[i, t] - behav[i, t])
            theta_over_prox = torch.exp(logprobs[i, t] - prox[i, t])
            objective = torch.minimum(theta_over_behav * adv[i],
                                      theta_over_prox.clamp(1 - eps, 1 + eps) * behav_weight * adv[i])
            total = total - objective
            count += 1
    return total / count


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_ppo_matches_the_paper_formula_in_value_and_gradient(cap):
    gen = torch.Generator().manual_seed(3)
    shape = (4, 7)
    behav = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2
    prox = behav + 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)  # a few versions newer
    theta = (prox + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    mask = torch.rand(shape, generator=gen) > 0.25
    mask[:, 0] = True

    correction = decoupled_ppo(prox, behav, mask, upper=cap)
    loss, _ = ppo_clip_loss(theta, prox, adv, correction.loss_mask, clip_low=0.2, clip_high=0.2,
                            loss_agg_mode="token_mean", is_weights=correction.weights)
    (grad,) = torch.autograd.grad(loss, theta)

    theta_ref = theta.detach().clone().requires_grad_()
    ref = _areal_reference(theta_ref, prox, behav, adv, mask, 0.2, cap)
    (grad_ref,) = torch.autograd.grad(ref, theta_ref)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-15)
    if cap is not None:
        dropped = mask & (torch.exp(prox - behav) > cap)
        assert dropped.any(), "the fixture should exercise the cap"
        assert not (correction.loss_mask & dropped).any()
        frac = correction.metrics["mismatch/is_masked_frac"].value
        assert float(frac) == pytest.approx(dropped.sum().item() / mask.sum().item())


def test_decoupled_ppo_rejects_a_non_positive_cap():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="upper > 0"):
        decoupled_ppo(x, x, torch.ones(1, 2, dtype=torch.bool), upper=0.0)


def test_loss_inputs_applies_decoupled_weights_from_the_config():
    lengths = [4, 6]
    cu = torch.tensor([0, 4, 10])
    mask = torch.ones(10, dtype=torch.bool)
    mask[cu[:-1]] = False
    rollout = torch.linspace(-2.0, -0.5, 10)
    old = rollout + torch.tensor([0, 0.1, 1.2, -0.3, 0, 0.2, 0.05, 2.0, -1.0, 0.3])
    batch = TrainBatch(input_ids=torch.arange(1, 11), cu_seqlens=cu, loss_mask=mask,
                       advantages=torch.tensor([1.0, -1.0]), rollout_logprobs=rollout, old_logprobs=old)
    algo = AlgorithmConfig(policy_loss="ppo_clip", rollout_correction="decoupled", rollout_correction_clip=2.0)
    inputs, metrics = fwd.loss_inputs(batch, algo, device="cpu", max_response_tokens=max(lengths))
    weights = torch.exp(old - rollout)
    expected_mask = mask & (weights <= 2.0)
    assert torch.equal(inputs.loss_mask, expected_mask)
    torch.testing.assert_close(inputs.is_weights, torch.where(expected_mask, weights, 0.0))
    assert float(metrics["mismatch/is_masked_frac"].value) == pytest.approx(2 / 8)
