"""perf/mfu: the FLOP formula against an independent count (the Linear weights of a built
transformers model, minus the experts a token does not visit), the peak table, the NaN cases."""
import math

import pytest
import torch

from megarl.launch import mfu
from megarl.launch.mfu import step_mfu


def _linear_weights(model) -> int:
    """Weights of every nn.Linear, from the built model."""
    return sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))


def _matmul_params(model) -> int:
    """Every parameter but embeddings, norms and biases (fused expert tensors included)."""
    return sum(p.numel() for n, p in model.named_parameters()
               if p.dim() >= 2 and "embed_tokens" not in n)


def _dense_cfg():
    return dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=200, tie_word_embeddings=False)


def test_dense_active_params_equal_the_built_models_linear_weights():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**_dense_cfg()))
    assert mfu.active_params(_dense_cfg()) == _linear_weights(model)


def test_moe_counts_only_top_k_and_shared_experts():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = dict(_dense_cfg(), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[])
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**cfg))
    one_expert = 3 * 64 * 32
    # the model holds all 8 routed experts of each of the 3 layers; a token visits top_k = 2
    assert mfu.active_params(cfg) == _matmul_params(model) - 3 * (8 - 2) * one_expert
    assert mfu.active_params(cfg) < mfu.active_params(dict(cfg, num_experts_per_tok=8))


def test_flops_per_token_hand_computed():
    cfg = dict(hidden_size=2, num_hidden_layers=1, num_attention_heads=1, intermediate_size=4, vocab_size=3)
    # attn 2*(1+2)*2 + 1*2*2 = 16, mlp 3*2*4 = 24, head 2*3 = 6 -> 46 active params
    assert mfu.active_params(cfg) == 46
    assert mfu.flops_per_token(cfg, seq_len=10) == 6 * 46 + 12 * 1 * 2 * 10
    assert mfu.mfu(cfg, tokens_per_s=1e9, seq_len=10, num_devices=2, peak=1.0) == pytest.approx(
        (6 * 46 + 240) * 1e9 / 2e12)


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "fp8", 1979.0), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA B200", "bf16", 2250.0)])
def test_peak_table(name, dtype, peak):
    assert mfu.peak_tflops(name, dtype) == peak


def test_cpu_or_unknown_gives_nan_unless_overridden():
    assert math.isnan(mfu.peak_tflops(""))
    assert math.isnan(mfu.peak_tflops("Tesla T4"))
    assert mfu.peak_tflops("", override=100.0) == 100.0
    cfg = _dense_cfg()
    assert math.isnan(step_mfu(cfg, {"perf/tokens_per_s": 10.0}, 50.0, 1, "", None))
    assert step_mfu(cfg, {"perf/tokens_per_s": 10.0}, 50.0, 1, "", 1.0) == pytest.approx(
        mfu.flops_per_token(cfg, 50.0) * 10.0 / 1e12)


def test_meter_reads_the_model_config_once_and_averages_the_step_s_sequence_lengths(tmp_path):
    """``MfuMeter`` (the step log's ``perf/mfu``): the model's ``config.json`` and the trajectories'
    mean prompt + response length into the formula; NaN without a model or a peak."""
    import json

    from megarl.rollout.types import Trajectory, TrajectoryGroup

    cfg = _dense_cfg()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lens = [(3, 5), (4, 12)]  # (prompt, response) tokens: mean sequence 12
    groups = [TrajectoryGroup(group_id=0, trajectories=[
        Trajectory(prompt_ids=torch.zeros(p, dtype=torch.int64), response_ids=torch.zeros(r, dtype=torch.int64),
                   loss_mask=torch.ones(r, dtype=torch.int64), rollout_logprobs=torch.zeros(r)) for p, r in lens])]
    meter = mfu.MfuMeter(model_dir=str(tmp_path), num_devices=2, on_cuda=False, peak_tflops=3.0)
    step = {"perf/tokens_per_s": 40.0}
    assert meter.of_step(step, groups) == pytest.approx(mfu.flops_per_token(cfg, 12.0) * 40.0 / (2 * 3.0e12))
    (tmp_path / "config.json").unlink()  # read once: the meter keeps the first read
    assert meter.of_step(step, groups) == pytest.approx(mfu.flops_per_token(cfg, 12.0) * 40.0 / (2 * 3.0e12))
    assert math.isnan(mfu.MfuMeter(None, 2, on_cuda=False, peak_tflops=3.0).of_step(step, groups))
    assert math.isnan(mfu.MfuMeter(str(tmp_path), 2, on_cuda=False, peak_tflops=None).of_step(step, groups))
