"""Qwen3.5-MoE family: Megatron config from config.json, the gated-attention and DeltaNet tensor layouts
against head-by-head references, the sectioned TP splits, the local hybrid block spec, and refusals.

References: the tiny model's config.json (written by transformers), transformers' own slicing of
``q_proj`` (``Qwen3_5MoeAttention.forward``: ``view(..., heads, 2 * head_dim).chunk(2)``) and of the
DeltaNet projections (``in_proj_qkv`` = ``[q; k; v]``), and Megatron's layouts written out here
(``linear_qkv`` per group ``[q; gate; k; v]``, ``attention.py`` ``get_query_key_value_tensors``;
``in_proj`` rows per TP rank ``[q_r; k_r; v_r; z_r; beta_r; alpha_r]``, ``gated_delta_net.py``).
"""
import json

import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.models.families import get_family
from megarl.models.mapping import gather_tp, lookup, split_tp, to_hf, to_megatron
from megarl.models.table import ModelLayout, TPSplit

FAMILY = get_family("qwen3_5_moe")
LAYOUT = ModelLayout(family="qwen3_5_moe", num_layers=4, hidden_size=3, num_attention_heads=4, num_query_groups=2,
                     head_dim=2, vocab_size=8, padded_vocab_size=8, linear_key_dim=4, linear_value_dim=8,
                     linear_value_heads=4)


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_qwen3_5_moe_dir):
    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_qwen3_5_moe_dir, ParallelConfig(), ModelConfig())
    assert cfg.experimental_attention_variant == "gated_delta_net"
    assert cfg.linear_attention_freq == [int(t == "linear_attention") for t in raw["layer_types"]] == [1, 1, 1, 0]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (raw["linear_num_key_heads"],
                                                                      raw["linear_num_value_heads"])
    assert cfg.attention_output_gate and cfg.qk_layernorm and cfg.layernorm_zero_centered_gamma
    assert cfg.moe_shared_expert_gate and cfg.moe_shared_expert_intermediate_size == raw["shared_expert_intermediate_size"]
    assert not cfg.moe_router_pre_softmax and cfg.moe_router_topk == raw["num_experts_per_tok"]
    kwargs = FAMILY.gpt_model_kwargs(FAMILY.architecture(_config(tiny_qwen3_5_moe_dir)))
    assert kwargs["rotary_percent"] == raw["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_gated_qkv_layout_matches_head_by_head_reference():
    entry, _ = lookup(FAMILY.table, "decoder.layers.3.self_attention.linear_qkv.weight")
    n, g, hd, h = 4, 2, 2, 3
    q_proj, k, v = torch.randn(n * 2 * hd, h), torch.randn(g * hd, h), torch.randn(g * hd, h)
    q, gate = q_proj.view(n, 2 * hd, h).chunk(2, dim=1)  # transformers' split of each head's rows
    expected = torch.cat([torch.cat([q[2 * j:2 * j + 2].reshape(-1, h), gate[2 * j:2 * j + 2].reshape(-1, h),
                                     k[j * hd:(j + 1) * hd], v[j * hd:(j + 1) * hd]]) for j in range(g)])
    fused = to_megatron(entry, [q_proj, k, v], LAYOUT)
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(to_hf(entry, fused, LAYOUT), [q_proj, k, v]))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_deltanet_in_proj_and_conv_split_per_section(size):
    entry, _ = lookup(FAMILY.table, "decoder.layers.0.self_attention.in_proj.weight")
    qkv, z, b, a = torch.randn(16, 3), torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    full = to_megatron(entry, [qkv, z, b, a], LAYOUT)
    assert all(torch.equal(x, y) for x, y in zip(to_hf(entry, full, LAYOUT), [qkv, z, b, a]))
    sections = [qkv[:4], qkv[4:8], qkv[8:], z, b, a]  # q, k, v, z, beta, alpha
    for r in range(size):
        expected = torch.cat([s.chunk(size)[r] for s in sections])
        assert torch.equal(split_tp(full, TPSplit.GDN_IN_PROJ, r, size, LAYOUT), expected)
    shards = [split_tp(full, TPSplit.GDN_IN_PROJ, r, size, LAYOUT) for r in range(size)]
    assert torch.equal(gather_tp(shards, TPSplit.GDN_IN_PROJ, LAYOUT), full)
    conv = torch.randn(16, 1, 4)
    shards = [split_tp(conv, TPSplit.GDN_CONV, r, size, LAYOUT) for r in range(size)]
    assert torch.equal(shards[-1], torch.cat([conv[:4].chunk(size)[-1], conv[4:8].chunk(size)[-1],
                                              conv[8:].chunk(size)[-1]]))
    assert torch.equal(gather_tp(shards, TPSplit.GDN_CONV, LAYOUT), conv)


def test_sectioned_split_needs_the_layout():
    with pytest.raises(ValueError, match="needs the model layout"):
        split_tp(torch.zeros(32, 3), TPSplit.GDN_IN_PROJ, 0, 2)


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
])
def test_unsupported_settings_are_refused(change, field):
    from transformers import Qwen3_5MoeTextConfig

    base = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                linear_num_value_heads=4)
    cfg = Qwen3_5MoeTextConfig(**{**base, **change})
    with pytest.raises(ValueError, match=field):
        FAMILY.architecture(cfg)


@pytest.mark.timeout(60)
def test_local_block_spec_places_deltanet_and_zero_centred_norms(tiny_qwen3_5_moe_dir):
    from megatron.core.transformer.attention import SelfAttention

    from megarl.training.local_gdn import LocalGatedDeltaNet, ZeroCenteredRMSNorm, local_hybrid_block_spec
    from megarl.training.model import build_transformer_config

    cfg = build_transformer_config(tiny_qwen3_5_moe_dir, ParallelConfig(), ModelConfig())
    block = local_hybrid_block_spec(cfg, None, pp_rank=0)
    mixers = [spec.submodules.self_attention.module for spec in block.layer_specs]
    assert mixers == [LocalGatedDeltaNet] * 3 + [SelfAttention]
    attention = block.layer_specs[3].submodules.self_attention.submodules
    assert attention.q_layernorm is attention.k_layernorm is ZeroCenteredRMSNorm
    assert block.layer_norm is ZeroCenteredRMSNorm
    assert all(s.submodules.input_layernorm is ZeroCenteredRMSNorm for s in block.layer_specs)
