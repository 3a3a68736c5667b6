"""Mapping transforms and TP sharding against independent per-head / per-row references."""
import pytest
import torch

from megarl.models.families import get_family
from megarl.models.mapping import (
    ModelLayout,
    TPSplit,
    Transform,
    gather_tp,
    global_name,
    hf_names_for,
    lookup,
    megatron_to_hf,
    padded_vocab_size,
    split_tp,
    template_of,
    to_hf,
    to_megatron,
)

LAYOUT = ModelLayout(family="qwen3_moe", num_layers=2, hidden_size=8, num_attention_heads=4,
                     num_query_groups=2, head_dim=3, vocab_size=10, padded_vocab_size=16,
                     num_experts=4, moe_layers=(True, True))
TABLE = get_family("qwen3_moe").table


def _qkv_reference(q, k, v, groups, head_dim):
    """Megatron's linear_qkv rows written out head by head: per group, its query heads, then k, v."""
    heads = q.shape[0] // head_dim
    per_group = heads // groups
    rows = []
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * head_dim:(h + 1) * head_dim])
        rows.append(k[g * head_dim:(g + 1) * head_dim])
        rows.append(v[g * head_dim:(g + 1) * head_dim])
    return torch.cat(rows)


def test_qkv_fusion_matches_head_by_head_reference_and_inverts():
    q, k, v = torch.randn(12, 8), torch.randn(6, 8), torch.randn(6, 8)
    entry, _ = lookup(TABLE, "decoder.layers.1.self_attention.linear_qkv.weight")
    fused = to_megatron(entry, [q, k, v], LAYOUT)
    assert torch.equal(fused, _qkv_reference(q, k, v, groups=2, head_dim=3))
    back = to_hf(entry, fused, LAYOUT)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_glu_and_vocab_transforms():
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    entry, _ = lookup(TABLE, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    assert entry.transform is Transform.GLU and entry.expert
    fused = to_megatron(entry, [gate, up], LAYOUT)
    assert torch.equal(fused[:5], gate) and torch.equal(fused[5:], up)
    emb = torch.randn(10, 8)
    entry, _ = lookup(TABLE, "embedding.word_embeddings.weight")
    padded = to_megatron(entry, [emb], LAYOUT)
    assert padded.shape == (16, 8) and torch.equal(padded[:10], emb) and not padded[10:].any()
    assert torch.equal(to_hf(entry, padded, LAYOUT)[0], emb)


@pytest.mark.parametrize("split", [s for s in TPSplit if not s.value.startswith("gdn_")])  # sectioned: Qwen3.5's test
@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_gather_roundtrip(split, size):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    shards = [split_tp(full, split, r, size) for r in range(size)]
    assert torch.equal(gather_tp(shards, split), full)
    if split is TPSplit.GLU and size == 2:  # rank r holds [gate_r; up_r]
        gate, up = full[:4], full[4:]
        assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))
    if split is TPSplit.ROW and size == 4:
        assert torch.equal(shards[3], full[:, 9:])


def test_templates_and_global_names():
    assert template_of("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == (
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight", {"L": 3, "E": 5})
    assert template_of("decoder.layers.0.mlp.experts.linear_fc2.weight7") == (
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}", {"L": 0, "E": 7})
    # chunk-local layer 1 is global layer 5; local expert 1 on EP rank 3 with 2 per rank is 7
    assert global_name("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight", layer_number=6,
                       ep_rank=3, num_local_experts=2) == "decoder.layers.5.mlp.experts.local_experts.7.linear_fc2.weight"
    # Transformer Engine grouped-GEMM names become canonical (local-spec) names.
    assert global_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", layer_number=1, ep_rank=1,
                       num_local_experts=4) == "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"


def test_local_and_te_names_map_to_the_same_hf_tensors():
    pairs = [
        ("decoder.layers.2.input_layernorm.weight", "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"),
        ("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight", "decoder.layers.2.mlp.experts.linear_fc1.weight3"),
        ("decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight", "decoder.layers.2.mlp.experts.linear_fc2.weight3"),
        ("decoder.layers.2.pre_mlp_layernorm.weight", "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"),
    ]
    for local, te in pairs:
        assert hf_names_for(local, LAYOUT) == hf_names_for(te, LAYOUT)
    assert hf_names_for("decoder.layers.2.mlp.experts.linear_fc1.weight3", LAYOUT) == [
        "model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="no HF mapping"):
        hf_names_for("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", LAYOUT)


def test_megatron_to_hf_tied_and_names():
    tied = ModelLayout(**{**LAYOUT.__dict__, "tie_word_embeddings": True})
    out = dict(megatron_to_hf([("output_layer.weight", torch.zeros(16, 8)),
                               ("embedding.word_embeddings.weight", torch.ones(16, 8)),
                               ("decoder.layers.1.mlp.router.weight", torch.ones(4, 8))], tied))
    assert set(out) == {"model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"}
    assert out["model.embed_tokens.weight"].shape == (10, 8)


def test_padded_vocab_size():
    assert padded_vocab_size(1000, 128, 1) == 1024
    assert padded_vocab_size(1000, 128, 2) == 1024
    assert padded_vocab_size(1025, 128, 2) == 1280
    assert padded_vocab_size(2048, 128, 2) == 2048
