"""Kimi-K2.5 family: the Megatron config from the nested ``text_config``, the mapping's shapes vs the
real (tiny) checkpoint, and mismatched or unsupported configs refused naming the field.

References: the tiny model's config.json and safetensors headers (written by transformers, then
renamed to the release's names by the family's tiny class).
"""
import copy
import json

import pytest

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import ConfigMismatchError, check_weights_match_config, expected_hf_shapes
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family, text_config_of
from megarl.testing.checkpoints import edited_hf_dir


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_text_config(tiny_kimi_k25_dir):
    from megarl.training.model import build_transformer_config

    text = json.loads((tiny_kimi_k25_dir / "config.json").read_text())["text_config"]
    cfg = build_transformer_config(tiny_kimi_k25_dir, ParallelConfig(), ModelConfig())
    assert cfg.multi_latent_attention and cfg.num_layers == text["num_hidden_layers"]
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (text["q_lora_rank"], text["kv_lora_rank"])
    assert cfg.num_moe_experts == text["n_routed_experts"] and cfg.moe_router_topk == text["num_experts_per_tok"]
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_layer_freq == [0] * text["first_k_dense_replace"] + [1] * (
        text["num_hidden_layers"] - text["first_k_dense_replace"])
    assert text_config_of(_config(tiny_kimi_k25_dir)).vocab_size == text["vocab_size"]


@pytest.mark.timeout(60)
def test_expected_shapes_are_the_checkpoints_text_tensors(tiny_kimi_k25_dir):
    reader = HFCheckpointReader(tiny_kimi_k25_dir)
    expected = expected_hf_shapes(_config(tiny_kimi_k25_dir))
    text = {k: reader.shape(k) for k in reader.keys() if k.startswith("language_model.")}
    assert expected == text
    assert len(text) < len(reader.keys())  # the vision tower and projector are not expected
    check_weights_match_config(tiny_kimi_k25_dir)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value, match", [
    ("num_hidden_layers", 3, "num_hidden_layers: 3 .* 2 layers"),
    ("n_routed_experts", 16, "num_experts"),
    ("vocab_size", 4096, "vocab_size"),
])
def test_mismatched_text_config_is_refused(tiny_kimi_k25_dir, tmp_path, field, value, match):
    text = json.loads((tiny_kimi_k25_dir / "config.json").read_text())["text_config"]
    model = edited_hf_dir(tiny_kimi_k25_dir, tmp_path / "model", text_config={**text, field: value})
    with pytest.raises(ConfigMismatchError, match=match):
        check_weights_match_config(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value, match", [
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("rope_interleave", False, "rope_interleave=False"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
])
def test_unsupported_text_settings_name_the_field(tiny_kimi_k25_dir, field, value, match):
    cfg = copy.deepcopy(_config(tiny_kimi_k25_dir))
    setattr(cfg.text_config, field, value)
    with pytest.raises(ValueError, match=match):
        get_family(cfg).architecture(cfg)
