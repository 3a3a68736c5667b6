"""GSPO / GSPO-token against the paper's equations (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7, 13).

The references below loop over sequences and take each sequence's loss tokens explicitly; the
gradient reference is the analytic derivative of eq. 5-7:
d/d logp_it [ (1/G) sum_i min(s_i A_i, clip(s_i) A_i) ] = active_i * A_i * s_i / (G * |y_i|),
with active_i false exactly when the clip term is selected (s_i > 1 + eps_high and A_i > 0, or
s_i < 1 - eps_low and A_i < 0).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import gspo_loss, gspo_token_loss
from megarl.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer

pytestmark = pytest.mark.timeout(60)
TOL = 1e-10


def _ragged_batch(seed: int, batch: int = 7, width: int = 9, noise: float = 0.15):
    """Random float64 batch with ragged masks, holes (tool tokens) and one fully masked row."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    logprobs = old + noise * torch.randn(batch, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask &= torch.rand(batch, width, generator=gen) > 0.2  # holes: tool-observation tokens
    mask[:, 0] = True
    mask[3] = False  # a sequence without loss tokens
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64)
    # Padding holds values that would poison a careless implementation.
    logprobs = torch.where(mask, logprobs, torch.full_like(logprobs, -math.inf))
    old = torch.where(mask, old, torch.full_like(old, math.nan))
    return logprobs.requires_grad_(), old, advantages, mask


def _paper_objective(logprobs, old, advantages, mask, clip_low, clip_high):
    """Eq. 5-7 sequence by sequence; returns (J, analytic dJ/dlogprobs)."""
    grad = torch.zeros_like(logprobs, dtype=torch.float64)
    terms, num_seqs = [], 0
    for i in range(logprobs.shape[0]):
        idx = [t for t in range(logprobs.shape[1]) if mask[i, t]]
        if not idx:
            continue
        num_seqs += 1
        log_ratio = sum(float(logprobs[i, t] - old[i, t]) for t in idx) / len(idx)
        s = math.exp(log_ratio)
        a = float(advantages[i])
        clipped_s = min(max(s, 1 - clip_low), 1 + clip_high)
        terms.append(min(s * a, clipped_s * a))
        active = not ((s > 1 + clip_high and a > 0) or (s < 1 - clip_low and a < 0))
        for t in idx:
            grad[i, t] = (a * s / len(idx)) if active else 0.0
    return sum(terms) / num_seqs, grad / num_seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clips", [(3e-4, 4e-4), (0.05, 0.08), (0.2, 0.28)])
def test_gspo_value_and_grad_match_paper(seed, clips):
    logprobs, old, advantages, mask = _ragged_batch(seed)
    loss, metrics = gspo_loss(logprobs, old, advantages, mask, clip_low=clips[0], clip_high=clips[1])
    loss.backward()
    objective, grad = _paper_objective(logprobs.detach(), old, advantages, mask, *clips)
    assert abs(loss.item() - (-objective)) <= TOL
    assert torch.allclose(logprobs.grad, -grad, rtol=0, atol=TOL)
    assert torch.isfinite(logprobs.grad).all()
    assert metrics["loss/seq_importance_ratio_mean"].weight.item() == mask.any(-1).sum().item()


def test_clip_band_is_exercised_by_the_reference_cases():
    """Guard: with clip 0.05/0.08 some sequences are clipped and some are not."""
    logprobs, old, advantages, mask = _ragged_batch(0)
    _, metrics = gspo_loss(logprobs, old, advantages, mask, clip_low=0.05, clip_high=0.08)
    clipped = metrics["loss/clip_frac_low"].value + metrics["loss/clip_frac_high"].value
    assert 0 < clipped.item() < 1


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_aggregation_modes_weight_sequence_loss_by_tokens(mode):
    """Sequence-level loss broadcast to tokens: token_mean = sum_i n_i l_i / N_tokens, etc."""
    logprobs, old, advantages, mask = _ragged_batch(5)
    loss, _ = gspo_loss(logprobs, old, advantages, mask, clip_low=0.05, clip_high=0.08, loss_agg_mode=mode)
    lengths = mask.sum(-1).to(torch.float64)
    seq_losses = []
    for i in range(mask.shape[0]):
        log_ratio = float((logprobs[i].detach() - old[i])[mask[i]].sum()) / max(int(lengths[i]), 1)
        s = math.exp(log_ratio)  # 1.0 for the empty sequence
        a = float(advantages[i])
        seq_losses.append(-min(s * a, min(max(s, 0.95), 1.08) * a))
    seq_losses = torch.tensor(seq_losses, dtype=torch.float64)
    num_seqs, num_tokens, width = (lengths > 0).sum(), lengths.sum(), mask.shape[1]
    expected = {
        "token_mean": (lengths * seq_losses).sum() / num_tokens,
        "seq_mean_token_mean": (seq_losses * (lengths > 0)).sum() / num_seqs,
        "seq_mean_token_sum": (lengths * seq_losses).sum() / num_seqs,
        "seq_mean_token_sum_norm": (lengths * seq_losses).sum() / (num_seqs * width),
    }[mode]
    assert abs(loss.item() - expected.item()) <= TOL


def test_on_policy_gradient_is_length_normalised_policy_gradient():
    """At logprobs == old_logprobs: grad = -(1/N_seqs) sum_i A_i mean_t grad logp_it (through logits)."""
    gen = torch.Generator().manual_seed(3)
    batch, width, vocab = 5, 6, 11
    logits = torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, vocab, (batch, width), generator=gen)
    mask = torch.rand(batch, width, generator=gen) > 0.3
    mask[:, 0] = True
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64)

    def token_logprobs():
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)

    logprobs = token_logprobs()
    loss, _ = gspo_loss(logprobs, logprobs.detach(), advantages, mask)
    (grad_gspo,) = torch.autograd.grad(loss, logits)
    lengths = mask.sum(-1).to(torch.float64)
    pg = -(advantages * (token_logprobs() * mask).sum(-1) / lengths).sum() / batch
    (grad_pg,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(grad_gspo, grad_pg, rtol=0, atol=1e-12)
    assert grad_pg.abs().max() > 1e-3


@pytest.mark.parametrize("loss_fn", [gspo_loss, gspo_token_loss])
def test_gradient_exactly_zero_outside_clip_band_with_clipping_sign(loss_fn):
    width = 4
    old = torch.full((4, width), -1.0, dtype=torch.float64)
    # Sequence log-ratios +0.3, -0.3 (outside 3e-4/4e-4), and the same with the other sign of A.
    shift = torch.tensor([0.3, -0.3, 0.3, -0.3], dtype=torch.float64)[:, None]
    logprobs = (old + shift).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, width, dtype=torch.bool)
    loss, metrics = loss_fn(logprobs, old, advantages, mask)
    loss.backward()
    assert torch.equal(logprobs.grad[:2], torch.zeros(2, width, dtype=torch.float64))
    assert (logprobs.grad[2:].abs() > 0.01).all()  # the other sign is not clipped
    assert metrics["loss/clip_frac_high"].value.item() == pytest.approx(0.25)
    assert metrics["loss/clip_frac_low"].value.item() == pytest.approx(0.25)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_token_equals_gspo_with_sequence_advantages(mode):
    logprobs, old, advantages, mask = _ragged_batch(11)
    normalizer = LossNormalizer.from_loss_mask(mask, max_response_tokens=16)
    kwargs = dict(clip_low=0.05, clip_high=0.08, loss_agg_mode=mode, normalizer=normalizer)
    loss_seq, _ = gspo_loss(logprobs, old, advantages, mask, **kwargs)
    (grad_seq,) = torch.autograd.grad(loss_seq, logprobs)
    token_advantages = advantages[:, None].expand_as(logprobs).clone()
    loss_tok, _ = gspo_token_loss(logprobs, old, token_advantages, mask, **kwargs)
    (grad_tok,) = torch.autograd.grad(loss_tok, logprobs)
    assert abs(loss_seq.item() - loss_tok.item()) <= TOL
    assert torch.allclose(grad_seq, grad_tok, rtol=0, atol=TOL)
    assert grad_seq.abs().max() > 1e-3


def test_gspo_token_matches_paper_eq13_with_token_advantages():
    """J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it); grad_it = active_it A_it s_i / (G |y_i|)."""
    logprobs, old, _, mask = _ragged_batch(4)
    gen = torch.Generator().manual_seed(9)
    token_adv = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    clip_low, clip_high = 0.05, 0.08
    loss, _ = gspo_token_loss(logprobs, old, token_adv, mask, clip_low=clip_low, clip_high=clip_high)
    loss.backward()
    objective, grad, num_seqs = 0.0, torch.zeros_like(old), int(mask.any(-1).sum())
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        if not idx:
            continue
        s = math.exp(sum(float(logprobs[i, t].detach() - old[i, t]) for t in idx) / len(idx))
        for t in idx:
            a = float(token_adv[i, t])
            objective += min(s * a, min(max(s, 1 - clip_low), 1 + clip_high) * a) / len(idx) / num_seqs
            active = not ((s > 1 + clip_high and a > 0) or (s < 1 - clip_low and a < 0))
            grad[i, t] = a * s / len(idx) / num_seqs if active else 0.0
    assert abs(loss.item() + objective) <= TOL
    assert torch.allclose(logprobs.grad, -grad, rtol=0, atol=TOL)


@pytest.mark.parametrize("loss_fn", [gspo_loss, gspo_token_loss])
def test_fully_masked_batch_gives_zero_loss_and_no_nan(loss_fn):
    logprobs = torch.full((2, 3), -math.inf, dtype=torch.float64, requires_grad=True)
    old = torch.full((2, 3), math.nan, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = loss_fn(logprobs, old, torch.ones(2, dtype=torch.float64), mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 3, dtype=torch.float64))
    for name, metric in metrics.items():
        assert not torch.isnan(metric.value), name


def test_gspo_rejects_token_level_advantages():
    logprobs, old, advantages, mask = _ragged_batch(0)
    with pytest.raises(ValueError, match="advantages must be \\[B\\]"):
        gspo_loss(logprobs, old, advantages[:, None].expand_as(old), mask)
