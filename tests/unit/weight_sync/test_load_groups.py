"""Buckets never split a group of tensors the engine's SGLang loader must see in one ``load_weights``
call (``Family.engine_load_groups``; issue 34 part 2).

The reference is SGLang 0.5.23's own source: its DeepSeek loader starts every call with an empty
``cached_a_proj`` and fuses ``q_a_proj`` with ``kv_a_proj_with_mqa`` only when both arrive in that
call. The DeepSeek-V3 recipe (configs/deepseek_v3_gpu.yaml: its parallel layout, engines and block-FP8
checkpoint) with buckets forced to one tensor each put the two in different buckets before.
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.models.families import get_family
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "configs" / "models"
LOADER = "srt/models/deepseek_common/deepseek_weight_loader.py"
QWEN3_DENSE = {  # Qwen3-8B's public architecture numbers (no dense config ships in configs/models)
    "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _config(name: str, layers: int) -> dict:
    cfg = dict(QWEN3_DENSE) if name == "qwen3-8b" else json.loads((MODELS / name / "config.json").read_text())
    cfg.get("text_config", cfg)["num_hidden_layers"] = layers  # Kimi-K2.5 nests its language model's
    return cfg


def _members(plan, family) -> dict[str, list[int]]:
    """``{group key (layer filled in): [bucket index of each member present]}``."""
    where = {t.name: b.index for b in plan.buckets for t in b.hf_tensors}
    pre = family.hf_prefix + "model.layers."  # Kimi-K2.5: language_model.model.layers.
    layers = max((int(n[len(pre):].split(".")[0]) for n in where if n.startswith(pre)), default=-1) + 1
    out = {}
    for group in family.engine_load_groups:
        for layer in range(layers):
            names = [t.format(L=layer) for t in group]
            out[names[0]] = [where[n] for n in names if n in where]
    return out


def test_sglang_deepseek_loader_fuses_q_a_and_kv_a_only_within_one_call():
    """What the DeepSeek group rests on, read from SGLang 0.5.23 itself: the cache is a local of
    ``do_load_weights`` (new every call) and a fused load needs both names in it."""
    import ast
    import importlib.util

    path = Path(importlib.util.find_spec("sglang").origin).parent / LOADER  # read, not imported (heavy)
    text = path.read_text()
    function, = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "do_load_weights"]
    source = ast.get_source_segment(text, function)
    assert "cached_a_proj = {} if fuse_qkv_a_proj else None" in source
    assert "q_a_proj_name in cached_a_proj\n" in source and "and kv_a_proj_name in cached_a_proj" in source
    group, = get_family("deepseek_v3").engine_load_groups
    assert sorted(t.rsplit(".", 2)[-2] for t in group) == ["kv_a_proj_with_mqa", "q_a_proj"]


@pytest.mark.timeout(120)
def test_deepseek_v3_recipe_keeps_q_a_and_kv_a_in_one_bucket(tmp_path):
    """The recipe's own plan (layout, engines, block-FP8 wire) on its checkpoint's config cut to
    4 layers (dense 0-2, MoE 3), buckets of 1 MiB (every weight matrix its own): each layer's pair shares a
    bucket (before: never), and every FP8 weight's scale travels with it."""
    from megarl.config import load_config
    from megarl.weight_sync.predict import plan_from_config

    cfg = _config("deepseek-v3-fp8", 4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = load_config(str(REPO / "configs" / "deepseek_v3_gpu.yaml"),
                      [f"model.hf_path={tmp_path}", "weight_sync.bucket_size_mb=1"])
    plan = plan_from_config(run)
    assert plan.quantization is not None and plan.engine_layout.tp_size == 8
    for bucket in plan.buckets:  # a boundary after every parameter of 1 MiB or more, except inside a group
        big = {p.param.load_group or p.param.name for p in bucket.params if p.param.nbytes >= 1 << 20}
        assert len(big) <= 1, f"bucket {bucket.index}: {sorted(big)}"
    members = _members(plan, get_family("deepseek_v3"))
    assert len(members) == 4
    for key, buckets in members.items():
        assert len(buckets) == 2 and len(set(buckets)) == 1, f"{key}: members in buckets {buckets}"
    for bucket in plan.buckets:
        wire = {t.name for t in bucket.wire}
        for t in bucket.wire:
            if t.scale_of is not None:
                assert t.scale_of.name in wire, f"bucket {bucket.index}: {t.name} without its weight"


@functools.cache
def _specs(name: str, tp: int):
    return tuple(param_specs_from_hf_config(_config(name, 2), tensor_model_parallel_size=tp))


FAMILY_MODELS = {"qwen3_moe": "qwen3-30b-a3b", "qwen3": "qwen3-8b", "deepseek_v3": "deepseek-v3",
                 "glm4_moe": "glm-4.5", "kimi_k2": "kimi-k2-like", "kimi_k25": "kimi-k2.5", "minimax_m2": "minimax-m2"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family_name", sorted(FAMILY_MODELS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bucket_kib=st.floats(min_value=1, max_value=256 * 1024), tp=st.sampled_from([1, 2, 4]),
       engine_tp=st.sampled_from([1, 2, 4]))
def test_random_bucket_sizes_never_split_a_load_group(family_name, bucket_kib, tp, engine_tp):
    """Any bucket size, trainer TP and engine TP: every group's members share a bucket, every HF
    tensor is sent exactly once, and a bucket is over its size only where it holds one parameter
    or one group (the size it may exceed for it)."""
    name = FAMILY_MODELS[family_name]
    specs = _specs(name, tp)
    family = get_family(_config(name, 2)["model_type"])
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1),
                      EngineLayout(tensor_parallel_size=engine_tp), specs, bucket_size_mb=bucket_kib / 1024)
    sent = Counter(t.name for t in plan.hf_tensors())
    assert sent == Counter(h.name for p in specs for h in p.hf)
    for key, buckets in _members(plan, family).items():
        assert len(set(buckets)) <= 1, f"{key}: members in buckets {buckets}"
    for bucket in plan.buckets:
        units = {p.param.load_group or p.param.name for p in bucket.params}
        assert bucket.nbytes <= plan.bucket_size_bytes or len(units) == 1
