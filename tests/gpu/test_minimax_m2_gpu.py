"""MiniMax-M2's local spec on CUDA (issue 37; ``@pytest.mark.gpu``, skipped without CUDA).

The q/k norms over all heads (``megarl.training.full_head_qk_norm.FullHeadRMSNorm``) take the place
of Megatron-Core's per-head norms; the CPU tests run them on gloo. Here the model is built on CUDA
with NCCL (world size 1): every parameter, the norm's weight slice included, must be on the GPU and
the logits must equal transformers' CPU forward of the same HF directory (fp32, one sequence per row
and the rows packed into one).

First run (2026-11-28, H200, transformers 5.17.0): 0.32. The cause was the reference: that
transformers ignores ``rotary_dim`` (huggingface/transformers #48241) and rotated whole heads of a tiny
config that stated only ``rotary_dim``. The tiny config now states ``partial_rotary_factor`` too
(``megarl/models/families/minimax_m2.py``, "The CUDA gap"; reproduced on CPU by
``tests/unit/models/test_minimax_m2_rotary.py``); the first check below names that cause if it comes back.
"""

import pytest

pytestmark = pytest.mark.gpu
BATCH, SEQ = 2, 48


@pytest.mark.timeout(300)
def test_minimax_m2_local_spec_on_cuda_matches_transformers(tiny_minimax_m2_dir):
    """transformers rotates the tiny model's ``rotary_dim`` dims (as megarl and SGLang do); then each logit
    within 1e-4 of transformers' CPU forward (fp32), batched and packed rows."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    from megarl.testing.family_forward import forward_gaps

    config = AutoConfig.from_pretrained(tiny_minimax_m2_dir)
    rotated = 2 * MiniMaxM2RotaryEmbedding(config).inv_freq.numel()
    assert rotated == config.rotary_dim, (
        f"transformers {transformers.__version__} rotates {rotated} dims of the tiny config, megarl "
        f"{config.rotary_dim}: the reference is wrong (huggingface/transformers #48241), not Megatron")
    gaps = forward_gaps(tiny_minimax_m2_dir, BATCH, SEQ, seed=7)
    print(f"transformers {transformers.__version__}: max |Megatron on CUDA - transformers on CPU|: {gaps}")
    assert max(gaps.values()) <= 1e-4, gaps
