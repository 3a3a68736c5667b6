"""KL estimators against the exact KL of two categorical distributions (Monte Carlo).

Tolerance: 4 standard errors of the Monte Carlo mean, the standard error estimated from the same
N = 200,000 samples (fixed seed, so the test is deterministic); each test also checks that the
standard error is small next to the quantity tested, so the tolerance is meaningful.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import kl_estimate, kl_penalty_loss

pytestmark = pytest.mark.timeout(60)
NUM_SAMPLES, VOCAB, SIGMAS = 200_000, 6, 4.0


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    ref_logits = theta + 0.5 * torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    old_logits = theta + 0.4 * torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    return gen, theta, torch.log_softmax(ref_logits, -1), torch.log_softmax(old_logits, -1)


def _exact_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logq)).sum()


def _mc(values: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error over the first dimension."""
    return values.mean(0), values.std(0) / values.shape[0] ** 0.5


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_match_exact_kl(estimator):
    gen, theta, ref_logp, _ = _setup()
    logp = torch.log_softmax(theta, -1)
    x = torch.multinomial(logp.exp(), NUM_SAMPLES, replacement=True, generator=gen)
    mean, se = _mc(kl_estimate(logp[x], ref_logp[x], estimator=estimator))
    exact = _exact_kl(logp, ref_logp)
    assert se < 0.03 * exact
    assert abs(mean - exact) < SIGMAS * se


def test_k2_matches_its_expectation_and_is_close_to_kl():
    """E[k2] = E_p[(log q/p)^2 / 2] exactly; it differs from KL only at third order in log q/p."""
    gen, theta, ref_logp, _ = _setup()
    logp = torch.log_softmax(theta, -1)
    x = torch.multinomial(logp.exp(), NUM_SAMPLES, replacement=True, generator=gen)
    mean, se = _mc(kl_estimate(logp[x], ref_logp[x], estimator="k2"))
    expectation = (logp.exp() * 0.5 * (ref_logp - logp) ** 2).sum()
    exact = _exact_kl(logp, ref_logp)
    assert abs(mean - expectation) < SIGMAS * se
    assert abs(expectation - exact) < 0.15 * exact  # close distributions: small bias


def _per_sample_grads(theta, x, estimate_fn):
    """Per-sample gradient of estimate_fn(logp[x]) w.r.t. theta: d/dlogp(x) * (e_x - p)."""
    logp = torch.log_softmax(theta, -1)
    logp_x = logp[x].clone().requires_grad_()
    (d_logp,) = torch.autograd.grad(estimate_fn(logp_x).sum(), logp_x)
    return d_logp[:, None] * (torch.nn.functional.one_hot(x, VOCAB).to(theta.dtype) - logp.exp())


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_importance_weighted_form_is_unbiased_in_value_and_gradient(estimator):
    """Samples from pi_old; E_old[rho k] = KL(pi_theta || ref) and E_old[grad(rho k)] = grad KL."""
    gen, theta, ref_logp, old_logp = _setup(1)
    x = torch.multinomial(old_logp.exp(), NUM_SAMPLES, replacement=True, generator=gen)
    logp = torch.log_softmax(theta, -1)
    values = kl_estimate(logp[x], ref_logp[x], estimator=estimator, old_logprobs=old_logp[x])
    mean, se = _mc(values)
    exact = _exact_kl(logp, ref_logp)
    assert se < 0.05 * exact
    assert abs(mean - exact) < SIGMAS * se

    grads = _per_sample_grads(
        theta, x, lambda lp: kl_estimate(lp, ref_logp[x], estimator=estimator, old_logprobs=old_logp[x])
    )
    grad_mean, grad_se = _mc(grads)
    theta_var = theta.clone().requires_grad_()
    (exact_grad,) = torch.autograd.grad(_exact_kl(torch.log_softmax(theta_var, -1), ref_logp), theta_var)
    assert (grad_se < 0.05 * exact_grad.abs().max()).all()
    assert ((grad_mean - exact_grad).abs() < SIGMAS * grad_se + 1e-12).all()


@pytest.mark.parametrize(("estimator", "direction"), [("k2", "reverse"), ("k3", "forward")])
def test_on_policy_gradient_directions(estimator, direction):
    """As on-policy losses: E[grad k2] = grad KL(pi || ref); E[grad k3] = grad KL(ref || pi)."""
    gen, theta, ref_logp, _ = _setup(2)
    logp = torch.log_softmax(theta, -1)
    x = torch.multinomial(logp.exp(), NUM_SAMPLES, replacement=True, generator=gen)
    grads = _per_sample_grads(theta, x, lambda lp: kl_estimate(lp, ref_logp[x], estimator=estimator))
    grad_mean, grad_se = _mc(grads)
    theta_var = theta.clone().requires_grad_()
    lp_var = torch.log_softmax(theta_var, -1)
    target = _exact_kl(lp_var, ref_logp) if direction == "reverse" else _exact_kl(ref_logp, lp_var)
    (exact_grad,) = torch.autograd.grad(target, theta_var)
    assert ((grad_mean - exact_grad).abs() < SIGMAS * grad_se + 1e-12).all()
    assert (grad_se < 0.05 * exact_grad.abs().max()).all()


def test_kl_penalty_loss_value_and_masking():
    logprobs = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, -0.7, -0.9]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -1.5, 0.0], [-0.5, -1.0, -0.2]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    loss, metrics = kl_penalty_loss(logprobs.requires_grad_(), ref, mask, kl_coef=0.1, estimator="k3")
    loss.backward()
    pairs = [(-1.0, -1.2), (-2.0, -1.5), (-0.5, -0.5), (-0.9, -0.2)]
    k3 = [math.exp(r - p) - 1 - (r - p) for p, r in pairs]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 4, rel=1e-12)
    assert metrics["kl/ref_k3"].value.item() == pytest.approx(sum(k3) / 4, rel=1e-12)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 2] == 0
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(logprobs, ref, estimator="k4")
