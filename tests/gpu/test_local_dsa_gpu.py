"""DeepSeek-V3.2's local DSA spec on CUDA (issue 37; ``@pytest.mark.gpu``, skipped without CUDA).

megarl builds DeepSeek Sparse Attention on the local spec on every device
(``megarl.training.local_dsa``: Megatron-Core 0.16.1's ``DSAttention`` / ``DSAIndexer`` subclassed;
``spec: auto`` takes it on CUDA too), so the CPU tests cannot show that a CUDA build puts the
indexer's projections, its key norm and rope, the top-k and the sparse attention's masks on the GPU.
Reference: transformers' own forward of the same HF directory on the CPU, fp32, one sequence per
row and the rows packed into one; and a bf16 backward on CUDA whose MLA gradients are finite and
nonzero while the frozen indexer gets none.
"""
import json

import pytest
import torch

from megarl.procs.local_ranks import free_port
from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers.models.deepseek_v32")  # transformers >= the release that adds V3.2
BATCH, SEQ = 2, 40  # past the indexer's top 8


def _env():
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


@pytest.mark.timeout(300)
def test_deepseek_v32_local_spec_on_cuda_matches_transformers(tiny_deepseek_v32_dir):
    """Each logit within 1e-4 of transformers' CPU forward (fp32), batched and packed rows."""
    from megarl.testing.family_forward import forward_gaps

    gaps = forward_gaps(tiny_deepseek_v32_dir, BATCH, SEQ, seed=5)
    print(f"max |Megatron on CUDA - transformers on CPU|: {gaps}")
    assert max(gaps.values()) <= 1e-4, gaps


def _grad_worker(rank, world_size, hf_dir, tokens):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.local_dsa import LocalDSAttention
    from megarl.training.model import build_model
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    state = initialize_parallel(ParallelConfig(), backend="nccl")
    try:
        chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), precision="bf16",
                             device="cuda", spec="auto")
        load_hf_weights(chunks, hf_dir, state)
        sparse = [m for m in chunks[0].modules() if isinstance(m, LocalDSAttention)]
        tokens = tokens.cuda()
        logits = chunks[0](tokens, torch.arange(tokens.shape[1], device="cuda").expand_as(tokens), None)
        logits.float().logsumexp(-1).mean().backward()
        attention = chunks[0].decoder.layers[0].self_attention
        grads = {}
        for name, p in attention.named_parameters():
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            grads[name] = (p.requires_grad,
                           None if g is None else (bool(torch.isfinite(g).all()), float(g.abs().sum())))
        return {"count": len(sparse), "devices": sorted({str(p.device) for p in attention.parameters()}),
                "grads": grads}
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.timeout(300)
def test_sparse_attention_backward_on_cuda(tiny_deepseek_v32_dir):
    config = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    (out,) = run_ranks(_grad_worker, 1, args=(str(tiny_deepseek_v32_dir), tokens), backend=None, env=_env(),
                       timeout_s=240, start_method="spawn")
    assert out["count"] == config["num_hidden_layers"] and out["devices"] == ["cuda:0"]
    for name, (trainable, grad) in out["grads"].items():
        if ".indexer." in name:
            assert not trainable and (grad is None or grad[1] == 0), f"{name}: the indexer is frozen"
        else:
            assert trainable and grad is not None and grad[0] and grad[1] > 0, f"{name}: {grad}"
