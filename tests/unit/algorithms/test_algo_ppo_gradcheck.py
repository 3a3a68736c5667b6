"""PPO-clip (DAPO clip-higher, dual clip) against the papers' objective, and gradcheck of every loss."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    POLICY_LOSSES,
    compute_policy_loss,
    entropy_bonus_loss,
    gspo_loss,
    gspo_token_loss,
    kl_penalty_loss,
    ppo_clip_loss,
)
from megarl.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer
from megarl.algorithms.packing import padded_from_packed

pytestmark = pytest.mark.timeout(60)


def _batch(seed: int, batch: int = 4, width: int = 5, noise: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 2 - 0.1
    logprobs = (old + noise * torch.randn(batch, width, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(batch, width, generator=gen) > 0.25
    mask[:, 0] = True
    mask[-1] = False
    advantages = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("clip_c", [None, 1.3])
def test_ppo_clip_matches_objective_per_token(clip_c):
    """J_t = min(r A, clip(r, 1-el, 1+eh) A), and max(J_t, c A) for A < 0 (Ye et al. 2020); token mean."""
    logprobs, old, advantages, mask = _batch(1, batch=6, width=8, noise=0.5)
    clip_low, clip_high = 0.2, 0.28
    clips = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
    loss, metrics = ppo_clip_loss(logprobs, old, advantages, mask, **clips)
    loss.backward()
    num_tokens = int(mask.sum())
    objective, grad, dual_hits = 0.0, torch.zeros_like(old), 0
    for i, t in mask.nonzero().tolist():
        r = math.exp(float(logprobs[i, t].detach() - old[i, t]))
        a = float(advantages[i, t])
        j = min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
        uses_r = j == r * a and not ((r > 1 + clip_high and a > 0) or (r < 1 - clip_low and a < 0))
        if clip_c is not None and a < 0 and j < clip_c * a:
            j, uses_r, dual_hits = clip_c * a, False, dual_hits + 1
        objective += j / num_tokens
        grad[i, t] = r * a / num_tokens if uses_r else 0.0
    assert loss.item() == pytest.approx(-objective, abs=1e-12)
    assert torch.allclose(logprobs.grad, -grad, rtol=0, atol=1e-12)
    if clip_c is not None:
        assert dual_hits > 0  # the case exercises the dual clip
        assert metrics["loss/dual_clip_frac"].value.item() == pytest.approx(dual_hits / num_tokens)


def test_ppo_clip_higher_asymmetric_band():
    old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[0.75, 0.85, 1.25, 1.3]], dtype=torch.float64)
    logprobs = ratios.log().requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, torch.ones(1, 4, dtype=torch.bool), clip_low=0.2, clip_high=0.28)
    loss.backward()
    # 0.75 < 0.8 (A<0) and 1.3 > 1.28 (A>0) are clipped; 0.85 and 1.25 are inside the band.
    assert logprobs.grad[0, 0].item() == 0.0 and logprobs.grad[0, 3].item() == 0.0
    assert logprobs.grad[0, 1].item() != 0.0 and logprobs.grad[0, 2].item() != 0.0
    assert metrics["loss/clip_frac_low"].value.item() == 0.25
    assert metrics["loss/clip_frac_high"].value.item() == 0.25
    assert metrics["loss/importance_ratio_max"].value.item() == pytest.approx(1.3)
    assert metrics["loss/importance_ratio_min"].value.item() == pytest.approx(0.75)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_gradcheck_policy_losses(name, mode):
    """Finite differences of the loss value == autograd gradient.

    GSPO-token's gradient is defined through stop-gradients (paper eq. 13-14), so it is the
    derivative of its value only when every token of a sequence has the same advantage (and
    rollout-correction weight); with
    per-token advantages it is checked analytically in test_algo_gspo.py instead.
    """
    logprobs, old, advantages, mask = _batch(2)
    if name == "gspo":
        advantages = advantages[:, 0]
    is_weights = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    if name == "gspo_token":  # constant along each sequence, as the docstring explains
        advantages, is_weights = advantages[:, :1].expand_as(old), is_weights[:, :1].expand_as(old)
    kwargs = dict(clip_low=0.1, clip_high=0.15, loss_agg_mode=mode)
    if name == "ppo_clip":
        kwargs["clip_c"] = 1.2
    normalizer = LossNormalizer.from_loss_mask(mask, max_response_tokens=7)

    def fn(lp):
        extra = dict(normalizer=normalizer, is_weights=is_weights)
        return compute_policy_loss(name, lp, old, advantages, mask, **extra, **kwargs)[0]

    assert torch.autograd.gradcheck(fn, (logprobs,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("importance_weighted", [False, True])
def test_gradcheck_kl_penalty(estimator, importance_weighted):
    logprobs, old, _, mask = _batch(3)
    ref = old + 0.2

    def fn(lp):
        return kl_penalty_loss(
            lp, ref, mask, kl_coef=0.5, estimator=estimator, old_logprobs=old if importance_weighted else None
        )[0]

    assert torch.autograd.gradcheck(fn, (logprobs,), eps=1e-6, atol=1e-8)


def test_gradcheck_entropy_bonus_and_packing():
    gen = torch.Generator().manual_seed(4)
    entropy = torch.rand(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda e: entropy_bonus_loss(e, mask, entropy_coef=0.1)[0], (entropy,))
    packed = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    cu_seqlens = torch.tensor([0, 3, 3, 7])
    assert torch.autograd.gradcheck(lambda v: padded_from_packed(v, cu_seqlens), (packed,))


@pytest.mark.parametrize("loss_fn", [gspo_loss, gspo_token_loss, ppo_clip_loss])
def test_packed_input_gives_same_loss_and_grad_as_padded(loss_fn):
    """A packed [T_total] batch converted with padded_from_packed == the padded batch built by hand."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 1, 4]
    packed_lp = torch.randn(sum(lengths), generator=gen, dtype=torch.float64).requires_grad_()
    packed_old = packed_lp.detach() + 0.05 * torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    packed_mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    cu_seqlens = torch.tensor([0, 3, 4, 8])
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    loss_packed, _ = loss_fn(
        padded_from_packed(packed_lp, cu_seqlens),
        padded_from_packed(packed_old, cu_seqlens),
        adv,
        padded_from_packed(packed_mask, cu_seqlens, pad_value=False),
        clip_low=0.02,
        clip_high=0.03,
    )
    (grad_packed,) = torch.autograd.grad(loss_packed, packed_lp)
    padded_lp = torch.zeros(3, 4, dtype=torch.float64)
    padded_old, padded_mask = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.bool)
    for i, (start, length) in enumerate(zip([0, 3, 4], lengths)):
        padded_lp[i, :length] = packed_lp.detach()[start : start + length]
        padded_old[i, :length] = packed_old[start : start + length]
        padded_mask[i, :length] = packed_mask[start : start + length]
    padded_lp.requires_grad_()
    loss_padded, _ = loss_fn(padded_lp, padded_old, adv, padded_mask, clip_low=0.02, clip_high=0.03)
    (grad_padded,) = torch.autograd.grad(loss_padded, padded_lp)
    assert loss_packed.item() == loss_padded.item()
    expected = torch.cat([grad_padded[i, :length] for i, length in enumerate(lengths)])
    assert torch.equal(grad_packed, expected)


def test_registry_names_and_errors():
    assert set(POLICY_LOSSES) == {"gspo", "gspo_token", "ppo_clip"}
    logprobs, old, advantages, mask = _batch(0)
    with pytest.raises(ValueError, match="algorithm.policy_loss"):
        compute_policy_loss("grpo", logprobs, old, advantages, mask)
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        ppo_clip_loss(logprobs, old, advantages, mask, clip_c=0.5)
    with pytest.raises(ValueError, match="old_logprobs shape"):
        ppo_clip_loss(logprobs, old[:, :2], advantages, mask)
    with pytest.raises(ValueError, match="clip_low"):
        gspo_loss(logprobs, old, advantages[:, 0], mask, clip_low=1.5)
