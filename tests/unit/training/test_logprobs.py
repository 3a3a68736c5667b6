"""Vocab-parallel logprobs / entropy at world size 1 against torch's full-vocabulary log_softmax."""
import pytest
import torch

from megarl.training.logprobs import (
    next_token_logprobs,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)


def _reference(logits, targets, vocab_size):
    logp = torch.log_softmax(logits.double()[:, :vocab_size], dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("vocab_size", [None, 37])
def test_logprobs_entropy_and_grads_match_log_softmax(vocab_size):
    torch.manual_seed(0)
    logits = (3 * torch.randn(11, 48, dtype=torch.float64)).requires_grad_()
    real = vocab_size or 48
    targets = torch.randint(0, real, (11,))
    weights = torch.randn(11, dtype=torch.float64)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_h = _reference(ref_logits, targets, real)
    ((ref_lp * weights).sum() + (ref_h * weights).sum()).backward()

    lp = vocab_parallel_logprobs(logits, targets, vocab_size=vocab_size)
    h = vocab_parallel_entropy(logits, vocab_size=vocab_size)
    _, h_fused = vocab_parallel_logprobs_and_entropy(logits.detach(), targets, vocab_size=vocab_size)
    torch.testing.assert_close(h_fused.double(), ref_h, rtol=1e-6, atol=1e-6)
    ((lp * weights).sum() + (h * weights).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-6)
    if vocab_size:
        assert (logits.grad[:, vocab_size:] == 0).all()


@pytest.mark.timeout(30)
def test_next_token_logprobs_shift_and_temperature():
    torch.manual_seed(1)
    logits = torch.randn(5, 16)
    ids = torch.randint(0, 16, (5,))
    lp, h = next_token_logprobs(logits, ids, temperature=0.5, entropy="metric")
    _, h_grad = next_token_logprobs(logits, ids, temperature=0.5, entropy="grad")
    torch.testing.assert_close(h, h_grad)
    ref = torch.log_softmax(logits / 0.5, -1)
    assert lp[0] == 0 and h[0] == 0
    torch.testing.assert_close(lp[1:], ref[:-1].gather(-1, ids[1:, None]).squeeze(-1))
    torch.testing.assert_close(h[1:], -(ref.exp() * ref).sum(-1)[:-1])


@pytest.mark.timeout(30)
def test_input_logits_not_modified():
    logits = torch.randn(3, 8)
    before = logits.clone()
    vocab_parallel_logprobs(logits, torch.tensor([0, 1, 2]))
    vocab_parallel_entropy(logits)
    assert torch.equal(logits, before)
