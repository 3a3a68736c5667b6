"""Megatron settings of a real run: fusions per layer spec, model.megatron_overrides (issue 18)."""
import dataclasses

import pytest

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.models.tiny import TinyModelSpec, _hf_config
from megarl.training.model import FUSIONS, build_transformer_config, fusion_settings, split_megatron_overrides


def test_fusions_on_under_te_off_on_local_spec_with_reasons():
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert set(FUSIONS) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    on, off = fusion_settings(use_te=True, is_moe=True, multi_latent_attention=False, grad_accum_kernel=True)
    assert on == {name: True for name in FUSIONS} and off == {}
    on, off = fusion_settings(use_te=True, is_moe=False, multi_latent_attention=True, grad_accum_kernel=False)
    assert {k for k, v in on.items() if not v} == {"gradient_accumulation_fusion", "apply_rope_fusion",
                                                  "moe_permute_fusion"} == set(off)
    on, off = fusion_settings(use_te=False, is_moe=True, multi_latent_attention=False, grad_accum_kernel=True)
    assert not any(on.values()) and set(off) == set(FUSIONS) and "CPU" in off["apply_rope_fusion"]


def test_cpu_config_has_fusions_off_and_overrides_apply_last():
    hf_config = _hf_config(TinyModelSpec(family="qwen3_moe"), 2048, 0, 1)[0]
    cfg = build_transformer_config(hf_config, ParallelConfig(), ModelConfig(), device="meta")
    assert not any(getattr(cfg, name) for name in FUSIONS)
    assert cfg.moe_router_dtype == "fp32"
    cfg = build_transformer_config(hf_config, ParallelConfig(),
                                   ModelConfig(megatron_overrides={"moe_router_dtype": "fp64",
                                                                   "attention_softmax_in_fp32": False}),
                                   device="meta")
    assert cfg.moe_router_dtype == "fp64" and cfg.attention_softmax_in_fp32 is False


def test_split_megatron_overrides():
    config, ddp = split_megatron_overrides({"moe_permute_fusion": False, "bucket_size": 10, "overlap_grad_reduce": True})
    assert config == {"moe_permute_fusion": False} and ddp == {"bucket_size": 10, "overlap_grad_reduce": True}
    with pytest.raises(ValueError, match="model.megatron_overrides.not_a_field"):
        split_megatron_overrides({"not_a_field": 1})
