"""A wrong weight push is an error before anything is sent: names, shapes, dtypes, missing tensors.

The reference is the tiny model's real ``model.safetensors`` (what the engine loaded at start).
"""
import dataclasses

import pytest
import torch

from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.manifest_checks import (
    WeightSyncError,
    check_local_params,
    check_plan_against_manifest,
    read_manifest,
)
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan


@pytest.fixture(scope="module")
def tiny_plan(tiny_moe_dir):
    from transformers import AutoConfig

    specs = param_specs_from_hf_config(AutoConfig.from_pretrained(tiny_moe_dir), tensor_model_parallel_size=2,
                                       dtype="float32")
    return build_plan(TrainerLayout(tensor_model_parallel_size=2), EngineLayout(tensor_parallel_size=2), specs,
                      bucket_size_mb=0.25), specs


def replace_tensor(plan, index: int, **changes):
    """A copy of ``plan`` whose ``index``-th HF tensor has ``changes`` (e.g. a typo in its name)."""
    buckets, seen = [], 0
    for b in plan.buckets:
        params = []
        for t in b.params:
            hf = list(t.param.hf)
            for j in range(len(hf)):
                if seen == index:
                    hf[j] = dataclasses.replace(hf[j], **changes)
                seen += 1
            params.append(dataclasses.replace(t, param=dataclasses.replace(t.param, hf=tuple(hf))))
        tensors = tuple(h for p in params for h in p.param.hf)
        buckets.append(dataclasses.replace(b, params=tuple(params), hf_tensors=tensors))
    return dataclasses.replace(plan, buckets=tuple(buckets))


def test_plan_from_config_matches_the_real_checkpoint(tiny_plan, tiny_moe_dir):
    plan, _ = tiny_plan
    manifest = read_manifest(tiny_moe_dir)
    check_plan_against_manifest(plan, manifest)
    assert {t.name: (t.shape, t.dtype) for t in plan.hf_tensors()} == manifest


def test_misnamed_tensor_is_an_error(tiny_plan, tiny_moe_dir):
    plan, _ = tiny_plan
    bad = replace_tensor(plan, 5, name="model.layers.0.mlp.experts.3.gate_projj.weight")
    with pytest.raises(WeightSyncError, match=r"unknown to the engine.*gate_projj.*never sends"):
        check_plan_against_manifest(bad, read_manifest(tiny_moe_dir))


def test_wrong_shape_and_dtype_are_errors(tiny_plan, tiny_moe_dir):
    plan, _ = tiny_plan
    name = next(plan.hf_tensors()).name
    with pytest.raises(WeightSyncError, match=rf"{name}: shape \(7, 64\) planned"):
        check_plan_against_manifest(replace_tensor(plan, 0, shape=(7, 64)), read_manifest(tiny_moe_dir))
    with pytest.raises(WeightSyncError, match=rf"{name}: dtype bfloat16 planned, engine checkpoint has float32"):
        check_plan_against_manifest(replace_tensor(plan, 0, dtype="bfloat16"), read_manifest(tiny_moe_dir))


def test_trainer_shards_are_checked_before_sending(tiny_plan):
    plan, specs = tiny_plan
    local = {}
    for bucket in plan.buckets:
        for transfer, source in bucket.contributions(1):
            local[transfer.param.name] = torch.zeros(source.shape)
    check_local_params(plan, 1, local)
    name = next(iter(local))
    with pytest.raises(WeightSyncError, match="shape"):
        check_local_params(plan, 1, {**local, name: torch.zeros(3)})
    with pytest.raises(WeightSyncError, match="dtype"):
        check_local_params(plan, 1, {**local, name: local[name].bfloat16()})
    with pytest.raises(WeightSyncError, match="does not hold"):
        check_local_params(plan, 1, {k: v for k, v in local.items() if k != name})


def test_synchronizer_refuses_a_plan_the_engine_does_not_match(tiny_plan, tiny_moe_dir):
    from megarl.weight_sync.sync import WeightSynchronizer

    plan, _ = tiny_plan
    bad = replace_tensor(plan, 0, name="model.embed_tokens.weights")
    with pytest.raises(WeightSyncError, match="model.embed_tokens.weights"):
        WeightSynchronizer(bad, "distributed", ["http://127.0.0.1:9"], rank=0, placement=None,
                           manifest=read_manifest(tiny_moe_dir))
