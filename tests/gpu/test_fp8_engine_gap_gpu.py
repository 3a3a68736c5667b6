"""The FP8-engine verification bound and the engine load proof on CUDA (``@pytest.mark.gpu``,
skipped without CUDA; run by tools/gpu_check.sh's ``tests`` step).

- :data:`megarl.training.fp8.FP8_ENGINE_VERIFY_TOLERANCE` was measured on CPU
  (tests/unit/training/test_fp8_engine_tolerance.py). Here the same block-FP8 copy of the
  DeepSeek-V3 twin (:mod:`megarl.testing.fp8_served`) runs on CUDA in bf16, as an engine serves
  it, against the fp32 model on CUDA: the mean |dlogprob| must stay under the bound that
  :func:`~megarl.training.fp8.verify_tolerance` gives a BF16 trainer against a block-FP8 engine,
  and above the bf16 model's own gap (the quantisation is there).
- :func:`megarl.weight_sync.load_proof.first_unwritten` on CUDA parameters: received tensors on
  the GPU (an NCCL receive) or the host are found, one changed bit is not, and a parameter SGLang
  marks as rewritten (``format_ue8m0``) is skipped rather than reported.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(240)
def test_block_fp8_engine_gap_on_cuda_is_within_the_bound(tiny_deepseek_v3_dir):
    from transformers import AutoModelForCausalLM

    from megarl.config.schema import TrainConfig
    from megarl.testing.fp8_served import quantise_served, token_logprobs
    from megarl.training.fp8 import FP8_ENGINE_VERIFY_TOLERANCE, verify_tolerance

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=dtype).to("cuda").eval()

    ref, served, bf16 = load(torch.float32), load(torch.bfloat16), load(torch.bfloat16)
    assert quantise_served(served) > 30  # 2 layers: MLA, dense MLP, 8 experts x 3, shared expert
    ids = torch.randint(0, ref.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0)).to("cuda")
    want = token_logprobs(ref, ids)
    fp8_gap = (token_logprobs(served, ids) - want).abs().mean().item()
    bf16_gap = (token_logprobs(bf16, ids) - want).abs().mean().item()
    bound = verify_tolerance(TrainConfig(), 1e-2, engine_block_fp8=True)
    print(f"CUDA {torch.cuda.get_device_name()}: mean |dlogprob| vs fp32: block-FP8 bf16 {fp8_gap:.3g}, "
          f"bf16 {bf16_gap:.3g}; bound {bound}")
    assert bound == FP8_ENGINE_VERIFY_TOLERANCE
    assert bf16_gap < fp8_gap < bound


def _engine_like(device):
    """An engine's fused layout on ``device``: ``qkv_proj`` (q 8 rows, k 4, v 4) and experts'
    ``w13_weight`` with 2 padded columns, bf16 as served."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = torch.nn.Linear(8, 16)
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.w13_weight = torch.nn.Parameter(torch.randn(4, 6, 10))
    return model.to(device=device, dtype=torch.bfloat16)


@pytest.mark.timeout(60)
def test_load_proof_on_cuda_parameters():
    from megarl.weight_sync.load_proof import first_unwritten

    attn, experts = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    model = _engine_like("cuda")
    qkv, w13 = model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.experts.w13_weight
    received = [(attn + "k_proj.weight", qkv.weight.data[8:12].clone()),
                (attn + "q_proj.bias", qkv.bias.data[:8].clone()),
                (experts + "2.up_proj.weight", w13.data[2, 3:, :8].clone())]
    assert first_unwritten(model, received) is None
    assert first_unwritten(model, [(n, t.cpu()) for n, t in received]) is None  # host tensors too
    assert first_unwritten(model, [(n, t.float()) for n, t in received]) is None  # cast to the parameter's dtype
    stale = received[2][1].clone()
    stale.view(torch.int16)[1, 3] ^= 1
    assert first_unwritten(model, received[:2] + [(received[2][0], stale)]) == 2
    qkv.weight_scale_inv = torch.nn.Parameter(torch.zeros(2, 1, dtype=torch.int32, device="cuda"), requires_grad=False)
    scale = [(attn + "k_proj.weight_scale_inv", torch.full((1, 1), 2.5, device="cuda"))]
    fresh = _engine_like("cuda")  # the proof caches a model's parameters: a new model for the marked one
    fresh.model.layers[0].self_attn.qkv_proj.weight_scale_inv = qkv.weight_scale_inv
    assert first_unwritten(fresh, scale) == 0
    marked = _engine_like("cuda")
    marked.model.layers[0].self_attn.qkv_proj.weight_scale_inv = torch.nn.Parameter(
        torch.zeros(2, 1, dtype=torch.int32, device="cuda"), requires_grad=False)
    marked.model.layers[0].self_attn.qkv_proj.weight_scale_inv.format_ue8m0 = True
    assert first_unwritten(marked, scale) is None
