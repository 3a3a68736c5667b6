"""GPU-only trainer checks (``@pytest.mark.gpu``, skipped without CUDA).

- The Transformer Engine layer spec (THD packed sequences, grouped GEMM) computes the same token
  logprobs as the local spec (dense masked attention, per-expert MLPs) from the same HF weights.
- An FP8 training step (Transformer Engine, delayed scaling and current tensorwise scaling) runs
  and its loss stays within 5% (relative) of the BF16 step's on the same batch and weights; the
  FP8 logprobs stay within 0.1 nats (mean absolute) of BF16's.
- Under the default history-free FP8 recipe (tensorwise) GSPO's first sequence ratio is 1.
"""
import pytest
import torch
from megarl_gpu_cases import needs_te

from megarl.testing.multiproc import run_ranks

pytestmark = [pytest.mark.gpu, needs_te]  # every test here builds the Transformer Engine layer spec


def _cfg(hf_dir, **train):
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = str(hf_dir), "cuda", "bf16"
    cfg.train.max_tokens_per_microbatch, cfg.train.lr = 256, 1e-5
    cfg.parallel.use_distributed_optimizer = False
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _trainer(cfg, spec):
    """A trainer whose model uses the given layer spec (``te`` or ``local``)."""
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.fp8 import fp8_config
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.optimizer import build_ddp, build_optimizer, build_scheduler
    from megarl.training.trainer import Trainer
    from megarl.training.trainer_build import build_parallel_state

    parallel = build_parallel_state(cfg)
    hf_config = load_hf_config(cfg.model.hf_path)
    chunks = build_model(hf_config, cfg.parallel, cfg.model, precision="bf16", device="cuda", spec=spec,
                         extra_config=fp8_config(cfg.train, is_moe=True, cuda=True) or None)
    load_hf_weights(chunks, cfg.model.hf_path, parallel)
    ddp = build_ddp(chunks, use_distributed_optimizer=False)
    optimizer = build_optimizer(cfg.train, ddp, use_distributed_optimizer=False)
    return Trainer(cfg, parallel=parallel, model_chunks=ddp, optimizer=optimizer,
                   scheduler=build_scheduler(cfg.train, optimizer, total_steps=10), hf_config=hf_config)


def _batch(hf_dir):
    from megarl_gpu_cases import make_batch
    from transformers import AutoConfig

    return make_batch(AutoConfig.from_pretrained(hf_dir).vocab_size)


def _spec_worker(rank, world_size, hf_dir, batch):
    from megarl.training.parallel_state import destroy_parallel

    out = {}
    for spec in ("te", "local"):
        trainer = _trainer(_cfg(hf_dir), spec)
        out[spec] = (trainer.compute_logprobs(batch), trainer._te_attention)
        del trainer
        destroy_parallel()
    return out


def _fp8_worker(rank, world_size, hf_dir, batch):
    from megarl.training.parallel_state import destroy_parallel

    out = {}
    for name, train in (("bf16", {}), ("fp8_delayed", {"fp8": "hybrid", "fp8_recipe": "delayed"}),
                        ("fp8_tensorwise", {"fp8": "e4m3", "fp8_recipe": "tensorwise"})):
        trainer = _trainer(_cfg(hf_dir, **train), "te")
        logprobs = trainer.compute_logprobs(batch)
        metrics = trainer.train_step(batch)
        out[name] = (logprobs, metrics["loss/policy"], metrics["optim/grad_norm"])
        del trainer
        destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_te_spec_matches_local_spec(tiny_moe_dir):
    batch = _batch(tiny_moe_dir)
    out = run_ranks(_spec_worker, 1, args=(str(tiny_moe_dir), batch), backend="nccl", timeout_s=540)[0]
    (te, te_thd), (local, local_thd) = out["te"], out["local"]
    assert te_thd and not local_thd
    mask = batch.loss_mask
    diff = (te - local)[mask].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.2, (float(diff.mean()), float(diff.max()))


@pytest.mark.timeout(600)
def test_fp8_step_runs_close_to_bf16(tiny_moe_dir):
    batch = _batch(tiny_moe_dir)
    gen = torch.Generator().manual_seed(1)
    batch = batch.replace(old_logprobs=-7.0 + 0.5 * torch.randn(batch.num_tokens, generator=gen))
    out = run_ranks(_fp8_worker, 1, args=(str(tiny_moe_dir), batch), backend="nccl", timeout_s=540)[0]
    bf16_logprobs, bf16_loss, _ = out["bf16"]
    for name in ("fp8_delayed", "fp8_tensorwise"):
        logprobs, loss, grad_norm = out[name]
        assert torch.isfinite(torch.tensor([loss, grad_norm])).all(), name
        assert loss == pytest.approx(bf16_loss, rel=0.05), name
        assert float((logprobs - bf16_logprobs)[batch.loss_mask].abs().mean()) < 0.1, name


def _first_ratio_worker(rank, world_size, hf_dir, batch):
    from megarl.training.parallel_state import destroy_parallel

    trainer = _trainer(_cfg(hf_dir, fp8="e4m3", fp8_recipe="tensorwise"), "te")
    metrics = trainer.train_step(batch)  # old_logprobs: the no-grad pass on the same weights
    destroy_parallel()
    return {k: v for k, v in metrics.items() if k.startswith("loss/")}


@pytest.mark.timeout(600)
def test_fp8_tensorwise_first_gspo_ratio_is_one(tiny_moe_dir):
    """Issue 18 item 11: with a history-free recipe (the default, ``tensorwise``) the old-logprob pass
    and the training forward quantise alike, so GSPO's first sequence ratio is 1 (well inside its
    3e-4 clip) and no sequence is clipped."""
    from megarl.config.schema import TrainConfig

    assert TrainConfig().fp8_recipe == "tensorwise"
    batch = _batch(tiny_moe_dir)  # old_logprobs unset: train_step computes them
    m = run_ranks(_first_ratio_worker, 1, args=(str(tiny_moe_dir), batch), backend="nccl", timeout_s=540)[0]
    assert abs(m["loss/seq_importance_ratio_min"] - 1) < 1e-5, m
    assert abs(m["loss/seq_importance_ratio_max"] - 1) < 1e-5, m
    assert m["loss/clip_frac_low"] == 0 and m["loss/clip_frac_high"] == 0, m
