"""Vocab-parallel logprobs / entropy on a 2-rank gloo group vs the full-vocabulary log_softmax."""
import pytest
import torch

from megarl.testing.multiproc import run_ranks


def _worker(rank, world_size, vocab_size):
    import torch.distributed as dist

    from megarl.training.logprobs import (
        vocab_parallel_entropy,
        vocab_parallel_logprobs,
        vocab_parallel_logprobs_and_entropy,
    )

    torch.manual_seed(0)  # same full tensors on both ranks
    full = 4 * torch.randn(9, 64, dtype=torch.float64)
    targets = torch.randint(0, vocab_size, (9,))
    weights = torch.randn(9, dtype=torch.float64)
    shard = full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    lp = vocab_parallel_logprobs(shard, targets, vocab_size=vocab_size, tp_group=dist.group.WORLD)
    h = vocab_parallel_entropy(shard, vocab_size=vocab_size, tp_group=dist.group.WORLD)
    ((lp * weights).sum() + (h * weights).sum()).backward()
    _, h_fused = vocab_parallel_logprobs_and_entropy(shard.detach(), targets, vocab_size=vocab_size,
                                                     tp_group=dist.group.WORLD)
    torch.testing.assert_close(h_fused, h.detach())
    return lp.detach(), h.detach(), shard.grad, full, targets, weights


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab_size", [64, 40])  # 40: rank 1 holds 8 real ids and 24 padding ids
def test_tp2_matches_full_vocabulary(vocab_size):
    out = run_ranks(_worker, 2, args=(vocab_size,), timeout_s=90)
    full, targets, weights = out[0][3], out[0][4], out[0][5]
    ref_logits = full.clone().requires_grad_()
    logp = torch.log_softmax(ref_logits[:, :vocab_size], dim=-1)
    ref_lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ref_h = -(logp.exp() * logp).sum(-1)
    ((ref_lp * weights).sum() + (ref_h * weights).sum()).backward()
    for lp, h, _, *_ in out:
        torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h.double(), ref_h.detach(), rtol=1e-6, atol=1e-6)
    grad = torch.cat([out[0][2], out[1][2]], dim=-1)
    torch.testing.assert_close(grad, ref_logits.grad, rtol=1e-6, atol=1e-6)
