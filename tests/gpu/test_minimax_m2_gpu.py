"""MiniMax-M2's local spec on CUDA (issue 37; ``@pytest.mark.gpu``, skipped without CUDA).

The q/k norms over all heads (``megarl.training.full_head_qk_norm.FullHeadRMSNorm``) take the place
of Megatron-Core's per-head norms; the CPU tests run them on gloo. Here the model is built on CUDA
with NCCL (world size 1): every parameter, the norm's weight slice included, must be on the GPU and
the logits must equal transformers' CPU forward of the same HF directory (fp32, one sequence per row
and the rows packed into one).
"""

import pytest

pytestmark = pytest.mark.gpu
BATCH, SEQ = 2, 48


@pytest.mark.timeout(300)
def test_minimax_m2_local_spec_on_cuda_matches_transformers(tiny_minimax_m2_dir):
    """Each logit within 1e-4 of transformers' CPU forward (fp32), batched and packed rows."""
    from megarl.testing.family_forward import forward_gaps

    gaps = forward_gaps(tiny_minimax_m2_dir, BATCH, SEQ, seed=7)
    print(f"max |Megatron on CUDA - transformers on CPU|: {gaps}")
    assert max(gaps.values()) <= 1e-4, gaps
