"""A tied checkpoint whose SGLang class keeps its own lm_head (Qwen3-MoE, GLM-4.5): every sync sends the
trainer's tied embedding as ``model.embed_tokens.weight`` and as ``lm_head.weight``, and the engine's
tensors (its untied view, megarl.rollout.engine_view) are exactly what the plan sends."""
from __future__ import annotations

import pytest
import torch

from megarl.models.families import get_family
from megarl.models.mapping import lookup, megatron_to_hf, split_tp
from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import engine_table, param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.specs import EngineSplit

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000, "torch_dtype": "float32"}


def _config(**fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{**QWEN3_MOE, **fields})


def _exported(specs) -> dict[str, list[str]]:
    return {s.name: [t.name for t in s.hf] for s in specs if s.hf}


def test_tied_embedding_is_also_sent_as_lm_head_where_sglang_keeps_it_apart():
    tied = _exported(param_specs_from_hf_config(_config(tie_word_embeddings=True)))
    assert tied["embedding.word_embeddings.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert "output_layer.weight" not in tied  # the trainer holds no output layer of its own
    untied = _exported(param_specs_from_hf_config(_config(tie_word_embeddings=False)))
    assert untied["embedding.word_embeddings.weight"] == ["model.embed_tokens.weight"]
    assert untied["output_layer.weight"] == ["lm_head.weight"]
    dense = _exported(param_specs_from_hf_config(_config(model_type="qwen3", tie_word_embeddings=True)))
    assert dense["embedding.word_embeddings.weight"] == ["model.embed_tokens.weight"]  # SGLang ties Qwen3 itself
    assert "lm_head.weight" not in {n for names in dense.values() for n in names}


@pytest.mark.parametrize("tp", [1, 2])
def test_both_tensors_are_the_trainers_embedding_rows(tp):
    """The copy instructions (traced from the mapping) give the embedding's unpadded rows under both names,
    and each HF tensor is split by SGLang as a vocab-parallel tensor."""
    hf_config = _config(tie_word_embeddings=True)
    family = get_family(hf_config)
    layout = family.layout(hf_config, tp_size=tp)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=tp)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp),
                      EngineLayout(), specs)
    placement = Placement(layout, engine_table(family, hf_config))
    transfer = next(t for b in plan.buckets for t in b.params if t.param.name == "embedding.word_embeddings.weight")
    assert [h.engine_split for h in transfer.param.hf] == [EngineSplit.VOCAB] * 2
    full = torch.randn(transfer.param.shape, generator=torch.Generator().manual_seed(0))
    entry, _ = lookup(family.table, transfer.param.name)
    shards = [split_tp(full, entry.tp_split, s.shard_index, len(transfer.sources)) for s in transfer.sources]
    rebuilt = [torch.full(h.shape, float("nan")) for h in transfer.param.hf]
    for piece in placement.pieces(transfer):
        n = piece.dst[1] - piece.dst[0]
        rebuilt[piece.hf_index].narrow(0, piece.dst[0], n).copy_(shards[piece.shard].narrow(0, piece.src[0], n))
    assert all(torch.equal(t, full[:1000]) for t in rebuilt)
    # the checkpoint converters keep the model tied: no lm_head.weight in an export
    assert [n for n, _ in megatron_to_hf([(transfer.param.name, full)], layout)] == ["model.embed_tokens.weight"]


def test_the_plan_matches_the_engines_untied_view_exactly(tiny_tied_moe_dir, tmp_path):
    """The trainer-side manifest of the tied checkpoint (what the engines hold) is the view's own, and the
    plan sends exactly it; the untied view itself needs no augmentation."""
    from transformers import AutoConfig

    from megarl.rollout.engine_view import served_model_dir
    from megarl.weight_sync.manifest_checks import check_plan_against_manifest, read_manifest

    manifest = read_manifest(tiny_tied_moe_dir)
    view = served_model_dir(tiny_tied_moe_dir, root=tmp_path)
    assert manifest == read_manifest(view)
    assert manifest["lm_head.weight"] == manifest["model.embed_tokens.weight"]
    specs = param_specs_from_hf_config(AutoConfig.from_pretrained(tiny_tied_moe_dir), dtype="float32")
    check_plan_against_manifest(build_plan(TrainerLayout(), EngineLayout(), specs), manifest)
