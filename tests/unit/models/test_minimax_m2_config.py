"""MiniMax-M2 family: Megatron config from config.json, mapping shapes vs the real checkpoint, the
full-head q/k norm against transformers' and its TP slices, the block spec, and refused settings.

References: the tiny model's config.json and safetensors headers (written by transformers 5.19),
transformers' ``MiniMaxM2RMSNorm`` (the norm of the whole ``q_proj(x)``), and the heads a TP rank
holds in Megatron's ``SelfAttention`` (query heads ``[r * n / tp, (r + 1) * n / tp)``; key group
``r // (tp / g)`` when the ``g`` groups are fewer than the ranks, ``attention.py`` lines 1416-1470).
"""
import json

import pytest
import torch
from megatron.core import parallel_state as mps

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import check_weights_match_config, expected_hf_shapes
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family

FAMILY = get_family("minimax_m2")


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_minimax_m2_dir):
    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_minimax_m2_dir, ParallelConfig(), ModelConfig())
    assert (cfg.num_query_groups, cfg.kv_channels) == (raw["num_key_value_heads"], raw["head_dim"])
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.moe_layer_freq == [1] * raw["num_hidden_layers"] and cfg.moe_shared_expert_intermediate_size is None
    assert cfg.num_moe_experts == raw["num_local_experts"] and cfg.moe_router_topk == raw["num_experts_per_tok"]
    assert cfg.moe_ffn_hidden_size == raw["intermediate_size"]  # the experts' width
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_bias_update_rate == 0.0 and not cfg.moe_router_topk_scaling_factor
    assert cfg.moe_router_num_groups is None and not cfg.moe_router_pre_softmax
    gpt = FAMILY.gpt_model_kwargs(FAMILY.architecture(_config(tiny_minimax_m2_dir)))
    assert gpt["rotary_percent"] == raw["rotary_dim"] / raw["head_dim"] == 0.5
    assert gpt["rotary_base"] == raw["rope_parameters"]["rope_theta"]


@pytest.mark.timeout(60)
def test_expected_shapes_match_real_checkpoint(tiny_minimax_m2_dir):
    reader = HFCheckpointReader(tiny_minimax_m2_dir)
    expected = expected_hf_shapes(_config(tiny_minimax_m2_dir))
    assert expected == {k: reader.shape(k) for k in reader.keys()}
    assert expected["model.layers.0.self_attn.q_norm.weight"] == (4 * 16,)
    assert expected["model.layers.0.self_attn.k_norm.weight"] == (2 * 16,)
    assert expected["model.layers.1.block_sparse_moe.e_score_correction_bias"] == (8,)
    check_weights_match_config(tiny_minimax_m2_dir)


def _norm(monkeypatch, heads, total, tp_size, tp_rank, head_dim=4):
    from types import SimpleNamespace

    from megarl.training.full_head_qk_norm import FullHeadRMSNorm

    monkeypatch.setattr(mps, "get_tensor_model_parallel_world_size", lambda: tp_size)
    monkeypatch.setattr(mps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    config = SimpleNamespace(num_attention_heads=total, num_query_groups=total, params_dtype=torch.float32)
    return FullHeadRMSNorm(config, head_dim, 1e-6, heads=heads)


def test_full_head_norm_equals_transformers_norm(monkeypatch):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    norm = _norm(monkeypatch, "query", 6, 1, 0)
    ref = MiniMaxM2RMSNorm(6 * 4, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        norm.weight.copy_(ref.weight)
    x = torch.randn(5, 2, 6, 4)  # [sq, b, heads, head_dim]
    expected = ref(x.reshape(5, 2, 24)).view(5, 2, 6, 4)
    torch.testing.assert_close(norm(x), expected, rtol=0, atol=1e-6)
    per_head = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # what Megatron's per-head norm computes
    assert (per_head * norm.weight.view(6, 4) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("heads, total, tp_size, expected", [
    ("query", 8, 2, [(0, 16), (16, 32)]),
    ("key", 4, 2, [(0, 8), (8, 16)]),
    ("key", 2, 4, [(0, 4), (0, 4), (4, 8), (4, 8)]),  # one key group per two ranks
])
def test_each_rank_multiplies_by_its_heads_slice(monkeypatch, heads, total, tp_size, expected):
    slices = [_norm(monkeypatch, heads, total, tp_size, r).local_slice for r in range(tp_size)]
    assert [(s.start, s.stop) for s in slices] == expected


def test_heads_that_do_not_divide_over_tp_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"query heads \(6\) do not divide over tensor_model_parallel_size=4"):
        _norm(monkeypatch, "query", 6, 4, 0)


@pytest.mark.timeout(60)
def test_block_spec_puts_the_full_head_norm_in_every_attention(tiny_minimax_m2_dir):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarl.training.full_head_qk_norm import FullHeadRMSNorm, use_full_head_qk_norm
    from megarl.training.model import build_transformer_config

    cfg = build_transformer_config(tiny_minimax_m2_dir, ParallelConfig(), ModelConfig())
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    assert use_full_head_qk_norm(block) == len(block.layer_specs) == 2
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention.submodules
        assert (attention.q_layernorm.module, attention.q_layernorm.params) == (FullHeadRMSNorm, {"heads": "query"})
        assert (attention.k_layernorm.module, attention.k_layernorm.params) == (FullHeadRMSNorm, {"heads": "key"})


_ENGINE_FIELDS = dict(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True)


@pytest.mark.parametrize("change, field", [
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"use_routing_bias": None}, "use_routing_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
    ({"attn_type_list": [0, 1]}, "attn_type_list"),
    ({"rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}},
     "rotary_dim"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantization_config"),
])
def test_unsupported_settings_are_refused(change, field):
    from transformers import MiniMaxM2Config

    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rotary_dim=8, num_local_experts=8, num_experts_per_tok=2, **_ENGINE_FIELDS)
    FAMILY.architecture(MiniMaxM2Config(**base))  # the base itself is accepted
    with pytest.raises(ValueError, match=field):
        FAMILY.architecture(MiniMaxM2Config(**{**base, **change}))

