"""GLM-4.5 family: Megatron config from config.json, mapping shapes vs the real checkpoint (with and
without q/k norm and q/k/v bias), the fused q/k/v bias layout, and rejected settings.

References: the tiny model's config.json and safetensors headers (written by transformers) and
Megatron's ``linear_qkv`` layout written out in the test.
"""
import copy
import json

import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import check_weights_match_config, expected_hf_shapes
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family
from megarl.models.mapping import lookup, to_hf, to_megatron


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_glm4_moe_dir):
    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_glm4_moe_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_glm4_moe_dir, ParallelConfig(), ModelConfig())
    assert not cfg.multi_latent_attention
    assert (cfg.num_query_groups, cfg.kv_channels) == (raw["num_key_value_heads"], raw["head_dim"])
    assert cfg.qk_layernorm is raw["use_qk_norm"] and cfg.add_qkv_bias is raw["attention_bias"]
    assert not cfg.add_bias_linear  # o_proj and MLPs have no bias
    first = raw["first_k_dense_replace"]
    assert cfg.moe_layer_freq == [0] * first + [1] * (raw["num_hidden_layers"] - first)
    assert cfg.num_moe_experts == raw["n_routed_experts"] and cfg.moe_router_topk == raw["num_experts_per_tok"]
    assert raw["n_group"] == 1 and cfg.moe_router_num_groups is None  # one group = no group limit
    assert cfg.moe_router_topk_scaling_factor == raw["routed_scaling_factor"]
    assert cfg.moe_shared_expert_intermediate_size == raw["moe_intermediate_size"] * raw["n_shared_experts"]
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_bias_update_rate == 0.0
    assert cfg.moe_router_dtype == "fp32" and cfg.moe_aux_loss_coeff == 0.0
    assert cfg.moe_router_load_balancing_type == "none"
    family = get_family("glm4_moe")
    gpt = family.gpt_model_kwargs(family.architecture(_config(tiny_glm4_moe_dir)))
    rope = raw["rope_parameters"]
    assert gpt["rotary_percent"] == rope["partial_rotary_factor"] and gpt["rotary_base"] == rope["rope_theta"]


@pytest.mark.timeout(60)
def test_expected_shapes_match_real_checkpoint(tiny_glm4_moe_dir):
    reader = HFCheckpointReader(tiny_glm4_moe_dir)
    expected = expected_hf_shapes(_config(tiny_glm4_moe_dir))
    assert expected == {k: reader.shape(k) for k in reader.keys()}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.gate_proj.weight"} <= set(expected)
    check_weights_match_config(tiny_glm4_moe_dir)


@pytest.mark.timeout(60)
def test_without_qk_norm_and_bias(tiny_glm4_moe_dir):
    from megarl.training.model import build_transformer_config

    cfg = copy.deepcopy(_config(tiny_glm4_moe_dir))
    cfg.use_qk_norm, cfg.attention_bias = False, False
    shapes = expected_hf_shapes(cfg)
    assert not any(k.endswith(("_norm.weight", ".bias")) and "self_attn" in k for k in shapes)
    megatron = build_transformer_config(cfg, ParallelConfig(), ModelConfig())
    assert not megatron.qk_layernorm and not megatron.add_qkv_bias


@pytest.mark.timeout(60)
def test_qkv_bias_is_fused_per_query_group(tiny_glm4_moe_dir):
    cfg = _config(tiny_glm4_moe_dir)
    family = get_family(cfg)
    layout = family.layout(cfg)
    heads, groups, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = torch.randn(heads * hd), torch.randn(groups * hd), torch.randn(groups * hd)
    entry, _ = lookup(family.table, "decoder.layers.0.self_attention.linear_qkv.bias")
    fused = to_megatron(entry, [q, k, v], layout)
    per_group = heads // groups  # Megatron: [q heads of group g; k_g; v_g] for each group g
    expected = torch.cat([torch.cat([q.view(groups, per_group * hd)[g], k.view(groups, hd)[g], v.view(groups, hd)[g]])
                          for g in range(groups)])
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(to_hf(entry, fused, layout), (q, k, v)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, "rope_type='linear'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
])
def test_unsupported_settings_name_the_field(tiny_glm4_moe_dir, field, value, match):
    cfg = copy.deepcopy(_config(tiny_glm4_moe_dir))
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        get_family(cfg).architecture(cfg)


RELEASED_CONFIG = {  # GLM-4.5's config.json
    "model_type": "glm4_moe", "attention_bias": True, "first_k_dense_replace": 3, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "intermediate_size": 12288, "max_position_embeddings": 131072, "moe_intermediate_size": 1536,
    "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": True,
    "vocab_size": 151552}


@pytest.mark.timeout(60)
def test_released_config_translates():
    from transformers import AutoConfig

    from megarl.training.model import build_transformer_config

    hf_config = AutoConfig.for_model(**RELEASED_CONFIG)
    cfg = build_transformer_config(hf_config, ParallelConfig(), ModelConfig(), precision="bf16", device="meta")
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.qk_layernorm, cfg.add_qkv_bias) == (8, 128, True, True)
    assert cfg.moe_layer_freq == [0] * 3 + [1] * 89 and cfg.moe_router_num_groups is None
    assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.moe_shared_expert_intermediate_size == 1536
    family = get_family(hf_config)
    arch = family.architecture(hf_config)
    assert arch["num_mtp_layers"] == 1 and family.gpt_model_kwargs(arch)["rotary_percent"] == 0.5
