"""Block-wise FP8 (e4m3) against a per-block loop reference, error bounds, the 448 edge, configs."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.models.fp8_blocks import (
    BlockFP8,
    dequantize_blockwise,
    parse_quantization_config,
    quantize_blockwise,
    scale_name,
)


def _reference_quantize(w: torch.Tensor, bn: int, bk: int):
    """One block at a time, the format's definition written out plainly."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            amax = max(block.abs().max().item(), 1e-12)
            scale = torch.tensor(amax, dtype=torch.float32) / 448.0
            s[i, j] = scale
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _reference_dequantize(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j]
    return out


SHAPES = [(256, 384), (300, 200), (1, 5), (129, 127), (128, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_per_block_loop(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])).to(dtype)
    q, s = quantize_blockwise(w, chunk_rows=1)  # several stripes
    q_ref, s_ref = _reference_quantize(w, 128, 128)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    deq = dequantize_blockwise(q, s, dtype=torch.float32, chunk_rows=1)
    assert torch.equal(deq, _reference_dequantize(q, s, 128, 128))
    assert torch.equal(dequantize_blockwise(q, s), deq.to(torch.bfloat16))  # fp32 product, then cast


def test_other_block_sizes_and_stripes_do_not_change_the_result():
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(3))
    q, s = quantize_blockwise(w, (16, 32), chunk_rows=2)
    q_ref, s_ref = _reference_quantize(w, 16, 32)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q1, s1 = quantize_blockwise(w, (16, 32), chunk_rows=100)
    assert torch.equal(s, s1) and torch.equal(q.view(torch.uint8), q1.view(torch.uint8))


def test_round_trip_error_bound_and_e4m3_max():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(384, 260, generator=gen) * 10 ** torch.empty(384, 1).uniform_(-4, 2, generator=gen)
    w[0, 0] = 1e4  # one huge element: its block's other elements go subnormal
    q, s = quantize_blockwise(w)
    deq = dequantize_blockwise(q, s, dtype=torch.float32)
    scale = s.repeat_interleave(128, 0)[:384].repeat_interleave(128, 1)[:, :260]
    normal = w.abs() >= scale * 2.0 ** -6
    err = (w - deq).abs()
    assert bool((err[normal] <= w.abs()[normal] / 16 * (1 + 1e-6)).all())
    assert bool((err[~normal] <= scale[~normal] * 2.0 ** -10 * (1 + 1e-6)).all())
    assert (~normal).any() and normal.any()
    # every block's largest element is +-448 exactly, nothing saturates to NaN
    qf = q.float()
    assert not torch.isnan(qf).any()
    per_block = torch.nn.functional.pad(qf.abs(), (0, 124, 0, 0)).view(3, 128, 3, 128).amax(dim=(1, 3))
    assert torch.equal(per_block, torch.full((3, 3), 448.0))
    assert deq[0, 0].item() == pytest.approx(1e4, rel=1e-6)


def test_zero_block_and_values_at_the_clamp():
    w = torch.zeros(130, 130)
    w[129, 129] = -3.0
    q, s = quantize_blockwise(w)
    assert (s > 0).all()
    assert torch.equal(dequantize_blockwise(q, s, dtype=torch.float32), w)
    # 4.64235... / (4.64235... / 448) rounds above 448 in fp32: clamped, never NaN
    amax = torch.tensor(4.642350673675537)
    assert (amax / (amax / 448.0)).item() > 448.0
    w = torch.full((4, 4), amax.item()) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    q, s = quantize_blockwise(w)
    assert torch.equal(q.float().abs(), torch.full((4, 4), 448.0))


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.zeros(4))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        quantize_blockwise(torch.zeros(4, 4, dtype=torch.int32))
    q, s = quantize_blockwise(torch.randn(200, 10))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_blockwise(q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_blockwise(q.float(), s)


def test_parse_quantization_config():
    cfg = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "modules_to_not_convert": ["model.layers.0.mlp"]})
    assert cfg == BlockFP8((128, 128), ("model.layers.0.mlp",))
    assert parse_quantization_config(None) is None and parse_quantization_config({}) is None
    for bad, field in [({"quant_method": "compressed-tensors"}, "quant_method"),
                       ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
                       ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
                       ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                        "activation_scheme")]:
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            parse_quantization_config(bad)


def test_which_tensors_are_quantized():
    cfg = BlockFP8(ignored=("model.layers.1.self_attn", "mlp.shared_experts"))
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight",
           "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.mlp.gate_up_proj.weight"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
          "model.layers.1.self_attn.o_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"]
    assert all(cfg.is_quantized(n, (256, 256)) for n in yes)
    assert not any(cfg.is_quantized(n, (256, 256)) for n in no)
    assert not cfg.is_quantized("model.layers.0.input_layernorm.weight", (256,))
    assert cfg.scale_shape((300, 128)) == (3, 1)
    assert scale_name("a.weight") == "a.weight_scale_inv"
