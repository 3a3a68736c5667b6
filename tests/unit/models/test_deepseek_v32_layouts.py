"""DeepSeek-V3.2 family: Megatron config from config.json, the indexer's per-head rope permutation
against a reference written out from both sides' rope code, expected shapes = the real tiny
checkpoint, the local DSA block spec, and refusals.

References: transformers' ``DeepseekV32Indexer`` (rope on the first ``qk_rope_head_dim`` dims of each
head, half-split pairs ``(i, i + r/2)``, ``rotate_half``) and Megatron-Core 0.16.1's
``DSAIndexer._apply_rope`` (rope on the last ``qk_pos_emb_head_dim`` dims, which
``_apply_rotary_pos_emb_bshd`` de-interleaves, ``x[0::2] ++ x[1::2]``, under MLA): both are run here on
the same vectors.
"""
import dataclasses
import json
import types

import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.models.families import get_family
from megarl.models.families.deepseek_v32 import indexer_rope_order
from megarl.models.mapping import lookup, to_hf, to_megatron
from megarl.models.table import ModelLayout

FAMILY = get_family("deepseek_v32")
LAYOUT = ModelLayout(family="deepseek_v32", num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=2,
                     head_dim=4, vocab_size=8, padded_vocab_size=8, index_head_dim=6, index_rope_dim=4)


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_deepseek_v32_dir):
    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_deepseek_v32_dir, ParallelConfig(), ModelConfig())
    assert cfg.experimental_attention_variant == "dsa" and cfg.multi_latent_attention
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (
        raw["index_n_heads"], raw["index_head_dim"], raw["index_topk"])
    assert cfg.dsa_indexer_loss_coeff == 0.0 and cfg.q_lora_rank == raw["q_lora_rank"]
    assert cfg.qk_pos_emb_head_dim == raw["qk_rope_head_dim"] and cfg.moe_layer_freq == [0, 1]
    assert FAMILY.layout(_config(tiny_deepseek_v32_dir)).index_rope_dim == raw["qk_rope_head_dim"]


def test_indexer_rope_order_is_written_out():
    # Megatron rows per head [pass (HF rows 4, 5); rope interleaved: HF 0, 2 (pair 0), 1, 3 (pair 1)]
    assert indexer_rope_order(LAYOUT).tolist() == [4, 5, 0, 2, 1, 3]
    with pytest.raises(ValueError, match="index_head_dim"):
        indexer_rope_order(dataclasses.replace(LAYOUT, index_rope_dim=3))


def _hf_rope(x, cos, sin, r):
    """transformers' indexer: rotate_half rope on the first r dims."""
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


def _megatron_rope(x, freqs, r):
    """Megatron's DSAIndexer._apply_rope under MLA (its own functions)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    nope, pe = x[..., :-r], x[..., -r:]
    return torch.cat([nope, _apply_rotary_pos_emb_bshd(pe, freqs, multi_latent_attention=True)], dim=-1)


def test_permuted_indexer_rows_give_transformers_scores():
    """q . k after each side's rope is equal when Megatron holds the permuted rows (and differs
    without the permutation)."""
    d, r, n, s, h = 6, 4, 2, 5, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    freqs = torch.outer(torch.arange(s).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, r]
    wq, wk, x = torch.randn(n * d, h), torch.randn(d, h), torch.randn(s, h)
    q, k = (x @ wq.t()).view(s, n, d), x @ wk.t()
    ref = torch.einsum("shd,td->sht", _hf_rope(q, emb.cos()[:, None], emb.sin()[:, None], r),
                       _hf_rope(k, emb.cos(), emb.sin(), r))
    ours = {}
    for name, w in (("linear_wq_b", wq), ("linear_wk", wk)):
        entry, _ = lookup(FAMILY.table, f"decoder.layers.0.self_attention.core_attention.indexer.{name}.weight")
        ours[name] = to_megatron(entry, [w], LAYOUT)
        assert torch.equal(to_hf(entry, ours[name], LAYOUT)[0], w)
    mq, mk = (x @ ours["linear_wq_b"].t()).view(s, n, d), x @ ours["linear_wk"].t()
    scores = torch.einsum("shd,td->sht", _megatron_rope(mq, emb[:, None, :], r),
                          _megatron_rope(mk[:, None], emb[:, None, :], r)[:, 0])
    assert torch.allclose(scores, ref, atol=1e-5)
    plain = torch.einsum("shd,td->sht", _megatron_rope(q, emb[:, None, :], r),
                         _megatron_rope(k[:, None], emb[:, None, :], r)[:, 0])
    assert not torch.allclose(plain, ref, atol=1e-2)


def test_expected_shapes_match_real_checkpoint(tiny_deepseek_v32_dir):
    from megarl.conversion.config_check import check_weights_match_config, expected_hf_shapes
    from megarl.conversion.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(tiny_deepseek_v32_dir)
    assert expected_hf_shapes(_config(tiny_deepseek_v32_dir)) == {k: reader.shape(k) for k in reader.keys()}
    check_weights_match_config(tiny_deepseek_v32_dir)


def test_local_block_spec_puts_dsa_into_every_mla_layer(tiny_deepseek_v32_dir):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarl.training.local_dsa import LocalDSAIndexer, LocalDSAttention, use_local_dsa_attention
    from megarl.training.model import build_transformer_config

    cfg = build_transformer_config(tiny_deepseek_v32_dir, ParallelConfig(), ModelConfig())
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    assert use_local_dsa_attention(block) == cfg.num_layers
    core = block.layer_specs[1].submodules.self_attention.submodules.core_attention
    assert core.module is LocalDSAttention and core.submodules.indexer.module is LocalDSAIndexer


def test_refusals(tiny_deepseek_v32_dir):
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.specs import SpecError

    raw = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="q_lora_rank=None"):
        FAMILY.architecture(_config_from({**raw, "q_lora_rank": None}))
    with pytest.raises(ValueError, match="mlp_layer_types"):
        FAMILY.architecture(_config_from({**raw, "mlp_layer_types": ["sparse", "sparse"]}))
    with pytest.raises(ValueError, match="index_head_dim=4 .*qk_rope_head_dim=8"):
        FAMILY.architecture(_config_from({**raw, "index_head_dim": 4}))
    with pytest.raises(SpecError, match="DeepSeek Sparse Attention's indexer"):
        param_specs_from_hf_config(raw)
    from megarl.training.model import _has_te_spec

    with pytest.raises(ValueError, match="spec='te': deepseek_v32's sparse attention"):
        _has_te_spec(FAMILY, _config(tiny_deepseek_v32_dir), "te")
    assert _has_te_spec(FAMILY, _config(tiny_deepseek_v32_dir), "auto") is False


def _config_from(raw: dict):
    """An HF-config-like object with ``raw``'s fields (``DeepseekV32Config`` itself refuses some)."""
    return types.SimpleNamespace(**raw)
