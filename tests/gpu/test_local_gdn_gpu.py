"""Qwen3.5-MoE's local spec on CUDA (issue 37; ``@pytest.mark.gpu``, skipped without CUDA).

megarl's ``LocalGatedDeltaNet`` replaces Megatron-Core 0.16.1's ``GatedDeltaNet`` where ``fla`` is
absent; Megatron's builds its conv and ``dt_bias`` / ``A_log`` on ``torch.cuda.current_device()`` and
megarl's on the configured device, so the CPU tests cannot show that a CUDA build puts every
parameter and every intermediate (the conv, the gate's ``softplus``, the chunked delta rule's masks)
on the GPU. Reference: transformers' own forward of the same HF directory on the CPU (its torch
fallbacks), fp32, one sequence per row and the rows packed into one (the recurrence restarts at
each packed sequence), and a backward pass on CUDA whose DeltaNet gradients are finite and nonzero.
"""
import json

import pytest
import torch

from megarl.procs.local_ranks import free_port
from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu
BATCH, SEQ = 2, 80  # past the gated delta rule's 64-token chunk


def _env():
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


@pytest.mark.timeout(300)
def test_qwen3_5_local_spec_on_cuda_matches_transformers(tiny_qwen3_5_moe_dir):
    """Each logit within 1e-4 of transformers' CPU forward (fp32), batched and packed rows."""
    from megarl.testing.family_forward import forward_gaps

    gaps = forward_gaps(tiny_qwen3_5_moe_dir, BATCH, SEQ, seed=5)
    print(f"max |Megatron on CUDA - transformers on CPU|: {gaps}")
    assert max(gaps.values()) <= 1e-4, gaps


def _grad_worker(rank, world_size, hf_dir, tokens):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.local_gdn import LocalGatedDeltaNet
    from megarl.training.model import build_model
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    state = initialize_parallel(ParallelConfig(), backend="nccl")
    try:
        chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), precision="bf16",
                             device="cuda", spec="local")
        load_hf_weights(chunks, hf_dir, state)
        deltanets = [m for m in chunks[0].modules() if isinstance(m, LocalGatedDeltaNet)]
        params = {n: p for d in deltanets[:1] for n, p in d.named_parameters()}
        tokens = tokens.cuda()
        logits = chunks[0](tokens, torch.arange(tokens.shape[1], device="cuda").expand_as(tokens), None)
        logits.float().logsumexp(-1).mean().backward()
        grads = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad) for n, p in params.items()}
        return {"count": len(deltanets),
                "devices": sorted({str(p.device) for d in deltanets for p in d.parameters()}),
                "grads": {n: (None if g is None else (str(g.device), bool(torch.isfinite(g).all()), float(g.abs().sum())))
                          for n, g in grads.items()}}
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.timeout(300)
def test_deltanet_backward_on_cuda(tiny_qwen3_5_moe_dir):
    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    (out,) = run_ranks(_grad_worker, 1, args=(str(tiny_qwen3_5_moe_dir), tokens), backend=None, env=_env(),
                       timeout_s=240, start_method="spawn")
    assert out["count"] == config["layer_types"].count("linear_attention")
    assert out["devices"] == ["cuda:0"]
    assert {"conv1d.weight", "A_log", "dt_bias", "in_proj.weight", "out_proj.weight"} <= set(out["grads"])
    for name, grad in out["grads"].items():
        assert grad is not None, f"{name}: no gradient"
        device, finite, total = grad
        assert device == "cuda:0" and finite and total > 0, f"{name}: {grad}"
