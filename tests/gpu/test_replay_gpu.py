"""R2 / R3 routing replay and a GSPO step on CUDA over NCCL (``@pytest.mark.gpu``; needs neither
Transformer Engine nor SGLang: without TE the trainer builds Megatron-Core's local layer spec).

The check of ``tools/gpu_check.sh`` (`megarl.testing.gpu_check.check_replay`) in fp32, in a fresh
process: the free forward's logprobs are the reference that replaying its own routes must reproduce
(within 1e-5), shifted routes must change them, and the first step's GSPO ratios are 1. Without
Transformer Engine this failed on CUDA in every MoE forward (Megatron-Core 0.16.1's router names
``te_general_gemm``, left undefined without TE; megarl only defined it on CPU).
"""
import pytest

from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def _worker(rank, world_size, workdir):
    from megarl.testing.gpu_check import check_replay

    return check_replay("cuda", "fp32", workdir)


@pytest.mark.timeout(300)
def test_r2_r3_replay_and_step_on_cuda(tmp_path):
    out = run_ranks(_worker, 1, args=(str(tmp_path),), backend=None, timeout_s=280, start_method="spawn")[0]
    assert out["device"].startswith("cuda")
    assert out["r2_old_vs_free"] <= 1e-5 and out["r3_replay_vs_free"] <= 1e-5, out
    assert out["r3_shifted_vs_free"] > 1e-4, out
    assert out["r3_missing_routes"] == "refused"
    for step in (out["r3_step"], out["r2_step"]):
        assert step["ratio_min"] == pytest.approx(1.0, abs=1e-5) and step["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert step["grad_norm"] > 0 and step["update_successful"] == 1.0
