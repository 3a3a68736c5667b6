"""The post-sync check's tolerance follows from what is served (issue 34 part 3).

``verify_tolerance`` for each trainer precision x engine checkpoint, and the measurement behind
:data:`megarl.training.fp8.FP8_ENGINE_VERIFY_TOLERANCE`: the mean |dlogprob| of a block-FP8 copy of
the DeepSeek-V3 CPU twin (``tiny:deepseek_v3``, what ``--cpu-scale`` gives the FP8 recipes) against
the fp32 model, every tensor SGLang quantises (:meth:`BlockFP8.is_quantized`, each expert's matrix
on its own) through :func:`quantize_blockwise` / :func:`dequantize_blockwise`, and the activations
into those linears quantised per token in groups of 128 as block-FP8 GEMMs do on GPU.
"""
from __future__ import annotations

import pytest
import torch

from megarl.config.schema import TrainConfig
from megarl.models.fp8_blocks import E4M3_MAX, BlockFP8, dequantize_blockwise, quantize_blockwise
from megarl.training.fp8 import FP8_ENGINE_VERIFY_TOLERANCE, FP8_VERIFY_TOLERANCE, verify_tolerance

BASE = 1e-2  # weight_sync.verify_tolerance's default


@pytest.mark.parametrize("trainer_fp8", [None, "e4m3"])
@pytest.mark.parametrize("engine_block_fp8", [False, True])
def test_tolerance_follows_trainer_and_served_precision(trainer_fp8, engine_block_fp8):
    """Each gap that is present adds its bound (mean |a - c| <= mean |a - b| + mean |b - c|); none
    present keeps the configured tolerance, which also stays when it is the larger."""
    train = TrainConfig(fp8=trainer_fp8)
    expected = BASE
    gaps = (FP8_VERIFY_TOLERANCE if trainer_fp8 else 0.0) + (FP8_ENGINE_VERIFY_TOLERANCE if engine_block_fp8 else 0.0)
    if gaps:
        expected = gaps
    assert verify_tolerance(train, BASE, engine_block_fp8=engine_block_fp8) == pytest.approx(expected)
    assert verify_tolerance(train, 10.0, engine_block_fp8=engine_block_fp8) == 10.0


def _act_quant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-token, per-``group``-channel e4m3 quantise-dequantise (DeepSeek-V3's FP8 activations)."""
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, (-cols) % group)).unflatten(-1, (-1, group))
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)[..., :cols]


def _block_fp8(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(w), dtype=w.dtype)


def _quantise_served(model) -> int:
    """Every weight SGLang serves as block FP8, quantised and dequantised in place (transformers 5
    fuses experts into ``[E, rows, cols]``, gate and up stacked: each checkpoint matrix on its own);
    activations into those linears quantised per token. Returns how many matrices."""
    rule, count = BlockFP8(), 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                halves = 2 if name.endswith("gate_up_proj") else 1
                for e in range(p.shape[0]):
                    for part in p.data[e].chunk(halves, dim=0):
                        part.copy_(_block_fp8(part.clone()))
                        count += 1
            elif rule.is_quantized(name, tuple(p.shape)):
                p.copy_(_block_fp8(p.data))
                count += 1
                module = model.get_submodule(name[:-len(".weight")])
                module.register_forward_pre_hook(lambda _, args: (_act_quant(args[0]),) + tuple(args[1:]))
    return count


@pytest.mark.timeout(120)
def test_block_fp8_engine_gap_of_the_cpu_twin_is_within_the_bound(tiny_deepseek_v3_dir):
    """The measurement in FP8_ENGINE_VERIFY_TOLERANCE's docstring: the twin's block-FP8 copy
    against fp32 on 16 random sequences of 64 tokens; larger than BF16's own gap, within the bound."""
    from transformers import AutoModelForCausalLM

    def logprobs(model, ids):
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    ref = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.float32).eval()
    served = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.bfloat16).eval()
    assert _quantise_served(served) > 30  # 2 layers: MLA, dense MLP, 8 experts x 3, shared expert
    ids = torch.randint(0, ref.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    want = logprobs(ref, ids)
    fp8_gap = (logprobs(served, ids) - want).abs().mean().item()
    bf16_gap = (logprobs(bf16, ids) - want).abs().mean().item()
    print(f"mean |dlogprob| vs fp32: block-FP8 {fp8_gap:.3g}, bf16 {bf16_gap:.3g}")
    assert bf16_gap < fp8_gap < FP8_ENGINE_VERIFY_TOLERANCE / 10


@pytest.mark.parametrize("recipe", ["deepseek_v3_gpu", "kimi_k2_gpu", "qwen3_30b_a3b_gpu", "glm45_gpu"])
def test_each_recipe_gets_the_tolerance_of_what_its_engines_serve(recipe):
    """The FP8-engine recipes (BF16 trainers) get the FP8-engine bound, where they had 1e-2 before;
    BF16 engines keep the trainer's rule (Qwen3-30B-A3B trains FP8). Reference: the served
    config.json on disk."""
    import json
    from pathlib import Path

    from megarl.config import load_config
    from megarl.launch.weight_sync_step import engines_serve_block_fp8

    repo = Path(__file__).resolve().parents[3]
    cfg = load_config(str(repo / "configs" / f"{recipe}.yaml"))
    on_disk = "quantization_config" in json.loads((repo / cfg.model.hf_path / "config.json").read_text())
    served = engines_serve_block_fp8(cfg)
    assert served == on_disk
    base = float(cfg.weight_sync.verify_tolerance)
    tolerance = verify_tolerance(cfg.train, base, engine_block_fp8=served)
    gaps = (FP8_VERIFY_TOLERANCE if cfg.train.fp8 else 0.0) + (FP8_ENGINE_VERIFY_TOLERANCE if on_disk else 0.0)
    assert tolerance == pytest.approx(max(base, gaps))
    if on_disk:  # DeepSeek-V3, Kimi-K2: BF16 trainers against FP8 engines
        assert cfg.train.fp8 is None and base < FP8_ENGINE_VERIFY_TOLERANCE <= tolerance
