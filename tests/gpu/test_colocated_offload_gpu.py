"""Colocated offload on a real GPU (issue 35 item 1; ``@pytest.mark.gpu``, skipped without CUDA).

``cluster.colocated_offload=optimizer_and_grads`` through `megarl.training.memory_limit` on megarl's
trainer (tiny Qwen3-MoE, BF16, distributed optimizer, NCCL, one rank, the local layer spec without
Transformer Engine): Megatron-Core's ``offload_to_cpu`` moves the FP32 main weights and Adam states
to the host and ``offload_grad_buffers`` frees the gradient buffers, so the rank's allocated CUDA
memory falls (by at least half the optimizer state's bytes: Adam's two states are two thirds); ``restore`` brings them back onto the rank's device bit for
bit, and the next step lands where a run without offload lands (a second trainer built after the
first: within a small fraction of the update, MoE dispatch may add in another order on CUDA).
On CPU the same path is tested with bit equality (tests/unit/training/test_colocated_offload.py).
"""
import pytest
import torch

from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def _state(optimizer) -> list:
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach())
                out.extend(v for _, v in sorted(opt.optimizer.state[p].items()) if torch.is_tensor(v))
    return out


def _both(rank, world_size, hf_dir, batches):
    """:func:`_one` with and without offload in one process (one Megatron import: the check's tests step
    has 300 s for every test)."""
    from megarl.training.parallel_state import destroy_parallel

    out = {}
    for mode in ("optimizer_and_grads", "none"):
        out[mode] = _one(hf_dir, batches, mode)
        destroy_parallel()
        torch.cuda.empty_cache()
    return out


def _one(hf_dir, batches, mode):
    from megarl.config.schema import MegarlConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training import memory_limit
    from megarl.training.trainer_build import build_trainer

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = str(hf_dir), "cuda", "bf16"
    cfg.train.max_tokens_per_microbatch, cfg.train.lr = 256, 1e-3
    cfg.parallel.use_distributed_optimizer = True
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    trainer.train_step(trainer.prepare_batch(batches[0]))
    device = trainer.device
    before = [t.detach().cpu().clone() for t in _state(trainer.optimizer)]
    params = [p.detach().cpu().clone() for p in trainer.model_chunks[0].parameters()]
    torch.cuda.synchronize(device)
    allocated = torch.cuda.memory_allocated(device)
    memory_limit.offload(trainer.optimizer, trainer.model_chunks, mode, device)
    out = {"freed_bytes": allocated - torch.cuda.memory_allocated(device),
           "state_bytes": sum(t.numel() * t.element_size() for t in before),
           "state_on_host": all(not t.is_cuda for t in _state(trainer.optimizer))}
    memory_limit.restore(trainer.optimizer, trainer.model_chunks, mode, device)
    after = _state(trainer.optimizer)
    out["state_back"] = all(t.device == device for t in after)
    out["state_same"] = len(after) == len(before) and all(torch.equal(a.cpu(), b) for a, b in zip(after, before))
    out["params_same"] = all(torch.equal(p.detach().cpu(), q) for p, q in zip(trainer.model_chunks[0].parameters(), params))
    trainer.train_step(trainer.prepare_batch(batches[1]))
    out["before_step"] = params
    out["after_step"] = [p.detach().float().cpu() for p in trainer.model_chunks[0].parameters()]
    return out


@pytest.mark.timeout(240)
def test_offload_frees_the_optimizer_and_grads_and_restores_them(tiny_moe_dir):
    from megarl_gpu_cases import make_batch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_moe_dir).vocab_size
    batches = [make_batch(vocab, seed=0), make_batch(vocab, seed=1)]
    (out,) = run_ranks(_both, 1, args=(str(tiny_moe_dir), batches), backend="nccl", timeout_s=200)
    off, plain = out["optimizer_and_grads"], out["none"]
    print(f"offload freed {off['freed_bytes'] / 2**20:.1f} MiB of CUDA memory; optimizer state "
          f"{off['state_bytes'] / 2**20:.1f} MiB")
    assert off["state_on_host"] and not plain["state_on_host"]
    # the Adam states alone are 2/3 of the state (the main weights may be views of a larger buffer)
    assert off["freed_bytes"] >= 0.5 * off["state_bytes"] and plain["freed_bytes"] == 0
    assert off["state_back"] and off["state_same"] and off["params_same"]
    for a, b, start in zip(off["after_step"], plain["after_step"], plain["before_step"]):
        update = (b - start.float()).abs().max()
        assert (a - b).abs().max() <= 0.05 * update + 1e-6
