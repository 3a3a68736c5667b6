"""Context parallelism on GPUs (``@pytest.mark.gpu``; needs CUDA and Transformer Engine).

- `partition_indices` (pure torch) = TE's ``thd_get_partitioned_indices`` on random padded rows.
- Same HF weights, same batch, same fixed ``old_logprobs``: a 2-GPU trainer at CP=2 (DP=1, TE
  ring attention on THD rows split over the two GPUs) computes the same logprobs, loss and
  gradient norm as at CP=1 (DP=2). Tolerances are bf16 ones: TE runs CP attention only in its
  flash / cuDNN fused backends (16-bit); its unfused fp32 backend has no CP, so an fp32 comparison
  at 1e-5 is not possible.
"""
import pytest
import torch
from megarl_gpu_cases import needs_te

from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


@needs_te
@pytest.mark.timeout(120)
def test_partition_matches_transformer_engine():
    from megarl.training.context_parallel import cp_padded_length, partition_indices

    gen = torch.Generator().manual_seed(0)
    for cp_size in (2, 4, 8):
        for _ in range(10):
            real = torch.randint(1, 300, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
            bounds = torch.tensor([0] + [cp_padded_length(n, cp_size) for n in real]).cumsum(0).to(torch.int32)
            total = int(bounds[-1])
            for rank in range(cp_size):
                ours = partition_indices(bounds, total, cp_size, rank, use_te=False)
                te = partition_indices(bounds, total, cp_size, rank, use_te=True)
                assert torch.equal(ours, te), (cp_size, rank, real)


def _cfg(hf_dir, cp_size):
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = str(hf_dir), "cuda", "bf16"
    cfg.train.max_tokens_per_microbatch, cfg.train.lr = 256, 1e-5
    cfg.parallel.use_distributed_optimizer = False
    cfg.parallel.context_parallel_size = cp_size
    cfg.algorithm.clip_low, cfg.algorithm.clip_high = 0.2, 0.3  # most sequences keep a gradient
    return cfg


def _cp_worker(rank, world_size, hf_dir, batch):
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer

    out = {}
    for name, cp_size in (("cp1", 1), ("cp2", 2)):
        cfg = _cfg(hf_dir, cp_size)
        trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
        assert trainer._te_attention and trainer.parallel.cp_size == cp_size
        logprobs = trainer.compute_logprobs(batch)
        if batch.old_logprobs is None:  # the CP=1 logprobs, perturbed, are both layouts' old_logprobs
            gen = torch.Generator().manual_seed(1)
            batch = batch.replace(old_logprobs=logprobs + 0.05 * torch.randn(batch.num_tokens, generator=gen))
        metrics = trainer.train_step(batch)
        out[name] = (logprobs, metrics["loss/total"], metrics["optim/grad_norm"], metrics["batch/num_microbatches"])
        del trainer
        destroy_parallel()
        torch.cuda.empty_cache()
    return out


@needs_te
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP=2 vs CP=1 needs 2 GPUs")
@pytest.mark.timeout(600)
def test_cp2_matches_cp1(tiny_moe_dir):
    from megarl_gpu_cases import make_batch
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size)
    out = run_ranks(_cp_worker, 2, args=(str(tiny_moe_dir), batch), backend=None, timeout_s=540)
    for rank in range(2):
        (lp1, loss1, norm1, _), (lp2, loss2, norm2, _) = out[rank]["cp1"], out[rank]["cp2"]
        diff = (lp1 - lp2)[batch.loss_mask].abs()
        assert float(diff.mean()) < 0.01 and float(diff.max()) < 0.1, (float(diff.mean()), float(diff.max()))
        assert torch.isfinite(torch.tensor([loss1, loss2, norm1, norm2])).all()
        assert norm1 > 0
        assert loss2 == pytest.approx(loss1, rel=2e-2, abs=2e-3)
        assert norm2 == pytest.approx(norm1, rel=5e-2)
