"""Batches for the GPU trainer tests (importable by spawned ranks)."""
import torch

from megarl.training.batch import TrainBatch


def make_batch(vocab_size: int, *, seed: int = 0, num_seqs: int = 8) -> TrainBatch:
    """Random sequences of 20-120 tokens, prompts of 8 tokens, advantages ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 121, (num_seqs,), generator=gen)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    mask = torch.ones(total, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start:start + 8] = False
    return TrainBatch(input_ids=torch.randint(0, vocab_size, (total,), generator=gen), cu_seqlens=cu,
                      loss_mask=mask, advantages=torch.randn(num_seqs, generator=gen),
                      rollout_logprobs=torch.zeros(total))
