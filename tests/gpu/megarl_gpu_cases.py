"""Batches and requirement markers for the GPU tests (importable by spawned ranks).

What each test needs beyond CUDA is explicit: `needs_te` (Transformer Engine, e.g. its layer spec,
FP8 or context-parallel attention). `tools/gpu_check.sh` runs this folder on a node without TE or
SGLang; those tests skip there and every other one must pass.
"""
import pytest
import torch

from megarl.training.batch import TrainBatch


def te_available() -> bool:
    """Transformer Engine's PyTorch extension imports (False when absent or broken, e.g. no cuDNN)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no TE
        return False
    return True


needs_te = pytest.mark.skipif(not torch.cuda.is_available() or not te_available(),
                              reason="needs CUDA and Transformer Engine")
"""Marks a test that needs Transformer Engine (skipped cleanly without it)."""


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
