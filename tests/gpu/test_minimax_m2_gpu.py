"""MiniMax-M2's local spec on CUDA (issue 37; ``@pytest.mark.gpu``, skipped without CUDA).

The q/k norms over all heads (``megarl.training.full_head_qk_norm.FullHeadRMSNorm``) take the place
of Megatron-Core's per-head norms; the CPU tests run them on gloo. Here the model is built on CUDA
with NCCL (world size 1): every parameter, the norm's weight slice included, must be on the GPU and
the logits must equal transformers' CPU forward of the same HF directory (fp32, one sequence per row
and the rows packed into one).
"""
import json

import pytest
import torch

from megarl.procs.local_ranks import free_port
from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu
BATCH, SEQ = 2, 48


@pytest.mark.timeout(300)
def test_minimax_m2_local_spec_on_cuda_matches_transformers(tiny_minimax_m2_dir):
    from transformers import AutoModelForCausalLM

    from megarl.testing.family_forward import megatron_logits

    config = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    (out,) = run_ranks(megatron_logits, 1, args=(str(tiny_minimax_m2_dir), tokens, {}, True, "cuda"),
                       backend=None, env=env, timeout_s=240, start_method="spawn")
    for logits, what in zip(out, ("batched", "packed")):
        diff = (logits[..., :config["vocab_size"]] - ref).abs().max().item()
        print(f"{what}: max |Megatron on CUDA - transformers on CPU| = {diff:.3g}")
        assert diff <= 1e-4, f"{what}: logit diff {diff:.3g}"
