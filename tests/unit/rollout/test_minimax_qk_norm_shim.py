"""MiniMax-M2's q/k norm of ``megarl/rollout/cpu_shims/sglang_minimax_qk_norm.py`` equals transformers'.

Reference: transformers' ``MiniMaxM2RMSNorm`` of width ``heads * head_dim`` applied to each token's
whole query and key (``models/minimax_m2/modeling_minimax_m2.py``). The shim functions are called as
SGLang 0.5.23's ``MiniMaxM2QKRMSNorm._forward_naive`` calls them: sums of squares per rank, all-reduced
(summed here) over the attention-TP ranks, then applied with each rank's heads' weight slice. The
end-to-end proof through the real server is ``tests/integration/weight_sync/test_load_proof.py``.
"""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.cpu_shims import sglang_minimax_qk_norm as shim

pytestmark = pytest.mark.timeout(60)

TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM, EPS = 5, 4, 2, 8, 1e-6


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    norm = MiniMaxM2RMSNorm(x.shape[-1], eps=EPS).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_over_tp_ranks_equals_transformers(tp, dtype):
    g = torch.Generator().manual_seed(tp)
    q = torch.randn(TOKENS, Q_HEADS * HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(TOKENS, KV_HEADS * HEAD_DIM, generator=g).to(dtype)
    wq = (1 + 0.1 * torch.randn(Q_HEADS * HEAD_DIM, generator=g)).to(dtype)
    wk = (1 + 0.1 * torch.randn(KV_HEADS * HEAD_DIM, generator=g)).to(dtype)
    shards = [(q.chunk(tp, -1)[r], k.chunk(tp, -1)[r]) for r in range(tp)]
    sums = [shim.rms_sumsq(qr, kr) for qr, kr in shards]
    assert sums[0].shape == ((2 * TOKENS + 3) // 4 * 4,) and sums[0].dtype == torch.float32
    total = torch.stack(sums).sum(0)  # attn_tp_all_reduce
    outs = [shim.rms_apply(qr, kr, wq.chunk(tp)[r], wk.chunk(tp)[r], total, tp, EPS) for r, (qr, kr) in enumerate(shards)]
    got_q, got_k = torch.cat([o[0] for o in outs], -1), torch.cat([o[1] for o in outs], -1)
    assert got_q.dtype == dtype and got_k.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, _reference(q, wq), atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, _reference(k, wk), atol=tol, rtol=tol)


def test_patch_sends_cpu_tensors_to_the_torch_functions_and_others_to_sglang():
    calls = []

    class Module:
        @staticmethod
        def rms_sumsq_serial(x1, x2):
            calls.append("sglang sumsq")

        @staticmethod
        def rms_apply_serial(*args):
            calls.append("sglang apply")

    module = Module()
    assert shim.patch_qk_norm(module)
    q, k = torch.randn(3, 8), torch.randn(3, 4)
    sums = module.rms_sumsq_serial(q, k)
    module.rms_apply_serial(q, k, torch.ones(8), torch.ones(4), sums, 1, EPS)
    assert calls == []  # CPU tensors never reach the CUDA-only kernels
    assert not shim.patch_qk_norm(object())  # a module without them: named on stderr, not patched
