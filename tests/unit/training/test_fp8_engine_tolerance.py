"""The post-sync check's tolerance follows from what is served (issue 34 part 3).

``verify_tolerance`` for each trainer precision x engine checkpoint, and the measurement behind
:data:`megarl.training.fp8.FP8_ENGINE_VERIFY_TOLERANCE`: the mean |dlogprob| of a block-FP8 copy of
the DeepSeek-V3 CPU twin (``tiny:deepseek_v3``, what ``--cpu-scale`` gives the FP8 recipes) against
the fp32 model (:mod:`megarl.testing.fp8_served`: every tensor SGLang quantises, block-FP8
quantised and dequantised, the activations into those linears quantised per token in groups of 128
as block-FP8 GEMMs do on GPU; tests/gpu/test_fp8_engine_gap_gpu.py measures the same on CUDA).
"""
from __future__ import annotations

import pytest
import torch

from megarl.config.schema import TrainConfig
from megarl.testing.fp8_served import quantise_served, token_logprobs
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


@pytest.mark.timeout(120)
def test_block_fp8_engine_gap_of_the_cpu_twin_is_within_the_bound(tiny_deepseek_v3_dir):
    """The measurement in FP8_ENGINE_VERIFY_TOLERANCE's docstring: the twin's block-FP8 copy
    against fp32 on 16 random sequences of 64 tokens; larger than BF16's own gap, within the bound."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.float32).eval()
    served = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.bfloat16).eval()
    assert quantise_served(served) > 30  # 2 layers: MLA, dense MLP, 8 experts x 3, shared expert
    ids = torch.randint(0, ref.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    want = token_logprobs(ref, ids)
    fp8_gap = (token_logprobs(served, ids) - want).abs().mean().item()
    bf16_gap = (token_logprobs(bf16, ids) - want).abs().mean().item()
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
    from megarl.launch.weight_sync_stage import engines_serve_block_fp8

    repo = Path(__file__).resolve().parents[3]
    cfg = load_config(str(repo / "configs" / f"{recipe}.yaml"))
    on_disk = "quantization_config" in json.loads((repo / cfg.model.hf_path / "config.json").read_text())
    served = engines_serve_block_fp8(cfg.model)
    assert served == on_disk
    base = float(cfg.weight_sync.verify_tolerance)
    tolerance = verify_tolerance(cfg.train, base, engine_block_fp8=served)
    gaps = (FP8_VERIFY_TOLERANCE if cfg.train.fp8 else 0.0) + (FP8_ENGINE_VERIFY_TOLERANCE if on_disk else 0.0)
    assert tolerance == pytest.approx(max(base, gaps))
    if on_disk:  # DeepSeek-V3, Kimi-K2: BF16 trainers against FP8 engines
        assert cfg.train.fp8 is None and base < FP8_ENGINE_VERIFY_TOLERANCE <= tolerance
