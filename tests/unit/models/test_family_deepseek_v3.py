"""DeepSeek-V3 family: Megatron config from config.json, mapping shapes vs the real checkpoint,
rejected settings, dropped multi-token-prediction layers, and the local-spec MLA shims.

References: the tiny model's config.json and safetensors headers (written by transformers), and
Megatron-Core's own classes for the shims.
"""
import copy
import json
import logging
import shutil

import pytest

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import ConfigMismatchError, check_weights_match_config, expected_hf_shapes
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family
from megarl.models.tiny import append_mtp_layer


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_deepseek_v3_dir):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_deepseek_v3_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_deepseek_v3_dir, ParallelConfig(), ModelConfig())
    rope = raw["rope_parameters"]
    assert isinstance(cfg, MLATransformerConfig) and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (raw["q_lora_rank"], raw["kv_lora_rank"])
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"])
    assert cfg.rope_type == "yarn" and cfg.rotary_base == rope["rope_theta"]
    assert cfg.rotary_scaling_factor == rope["factor"] and cfg.mscale_all_dim == rope["mscale_all_dim"]
    assert cfg.original_max_position_embeddings == rope["original_max_position_embeddings"]
    assert not cfg.rotary_interleaved and not cfg.apply_rope_fusion and cfg.qk_layernorm
    first = raw["first_k_dense_replace"]
    assert cfg.moe_layer_freq == [0] * first + [1] * (raw["num_hidden_layers"] - first)
    assert cfg.num_moe_experts == raw["n_routed_experts"] and cfg.moe_router_topk == raw["num_experts_per_tok"]
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (raw["n_group"], raw["topk_group"])
    assert cfg.moe_router_topk_scaling_factor == raw["routed_scaling_factor"]
    assert cfg.moe_shared_expert_intermediate_size == raw["moe_intermediate_size"] * raw["n_shared_experts"]
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_bias_update_rate == 0.0  # the rollout engine keeps the checkpoint's bias
    # The trainer's router defaults apply to this family too.
    assert cfg.moe_router_dtype == "fp32" and cfg.moe_aux_loss_coeff == 0.0
    assert cfg.moe_router_load_balancing_type == "none"


@pytest.mark.timeout(60)
def test_expected_shapes_match_real_checkpoint(tiny_deepseek_v3_dir):
    reader = HFCheckpointReader(tiny_deepseek_v3_dir)
    expected = expected_hf_shapes(_config(tiny_deepseek_v3_dir))
    assert expected == {k: reader.shape(k) for k in reader.keys()}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in expected
    check_weights_match_config(tiny_deepseek_v3_dir)


@pytest.mark.timeout(60)
def test_q_lora_rank_none_maps_q_proj(tiny_deepseek_v3_dir):
    cfg = _config(tiny_deepseek_v3_dir)
    cfg.q_lora_rank = None
    shapes = expected_hf_shapes(cfg)
    heads, q_head = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (heads * q_head, cfg.hidden_size)
    assert not any("q_a_proj" in k or "q_b_proj" in k or "q_a_layernorm" in k for k in shapes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value, match", [
    ("rope_interleave", False, "rope_interleave=False"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("num_experts_per_tok", 4, "topk_group=1 .*top-4 scores, HF by their top-2"),
    ("num_experts_per_tok", 1, "num_experts_per_tok=1"),
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("moe_layer_freq", 2, "moe_layer_freq=2"),
    ("attention_bias", True, "attention_bias=True"),
    ("n_shared_experts", 0, "n_shared_experts=0"),
    # block FP8 (the official release) is dequantised while read; per-tensor FP8 and other methods are not
    ("quantization_config", {"quant_method": "fp8"}, r"quantization_config.weight_block_size=None"),
    ("quantization_config", {"quant_method": "compressed-tensors"}, r"quantization_config.quant_method='compressed-tensors'"),
])
def test_unsupported_settings_name_the_field(tiny_deepseek_v3_dir, field, value, match):
    cfg = copy.deepcopy(_config(tiny_deepseek_v3_dir))
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        get_family(cfg).architecture(cfg)


@pytest.mark.timeout(60)
def test_mtp_layers_are_dropped_with_a_note(tiny_deepseek_v3_dir, tmp_path, caplog):
    with_mtp = append_mtp_layer(shutil.copytree(tiny_deepseek_v3_dir, tmp_path / "mtp"))
    with caplog.at_level(logging.WARNING, logger="megarl.models.families.deepseek_v3"):
        check_weights_match_config(with_mtp)
    assert "1 multi-token-prediction layer(s) (HF model.layers.2..2) are dropped" in caplog.text
    assert not any(k.startswith("model.layers.2.") for k in expected_hf_shapes(_config(with_mtp)))
    undeclared = append_mtp_layer(shutil.copytree(tiny_deepseek_v3_dir, tmp_path / "undeclared"), declare=False)
    with pytest.raises(ConfigMismatchError, match="num_hidden_layers: 2 in .*config.json, but the weights .* have 3 layers"):
        check_weights_match_config(undeclared)


@pytest.mark.timeout(60)
def test_local_mla_attention_shim_is_still_needed():
    """Megatron-Core 0.16.1's local DotProductAttention rejects MLA's k_channels (issue #1589)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.training.local_mla import LocalMLADotProductAttention, local_attention_accepts_mla

    assert not local_attention_accepts_mla(), "Megatron-Core now accepts k_channels: drop megarl.training.local_mla"
    with pytest.raises(TypeError, match="k_channels"):
        DotProductAttention(None, 1, None, "self", k_channels=24, v_channels=16)
    assert issubclass(LocalMLADotProductAttention, DotProductAttention)


@pytest.mark.timeout(60)
def test_mla_te_detection_fix_is_still_needed():
    """Without Transformer Engine, multi_latent_attention's TELinear is a MagicMock, so its
    ``HAVE_TE and isinstance(x, TELinear)`` check raises unless HAVE_TE is corrected."""
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.transformer.multi_latent_attention as mla

    from megarl.training.local_mla import fix_mla_te_detection

    if te_extension.HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(TypeError, match="isinstance"):
        isinstance(object(), mla.TELinear)
    fix_mla_te_detection()
    assert mla.HAVE_TE is False


RELEASED_CONFIG = {  # DeepSeek-V3's config.json (bf16 conversion: no quantization_config)
    "model_type": "deepseek_v3", "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280}


@pytest.mark.timeout(60)
def test_released_config_translates():
    from transformers import AutoConfig

    from megarl.training.model import build_transformer_config

    cfg = build_transformer_config(AutoConfig.for_model(**RELEASED_CONFIG), ParallelConfig(), ModelConfig(),
                                   precision="bf16", device="meta")
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert cfg.original_max_position_embeddings == 4096 and cfg.rotary_base == 10000
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk) == (8, 4, 8)
    assert cfg.moe_layer_freq == [0] * 3 + [1] * 58 and cfg.moe_shared_expert_intermediate_size == 2048
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
