"""``megarl eval`` reserves only what evaluation uses (issue 35 item 6): the engines' devices, not the
training placement's trainer bundles, which would sit idle on a GPU cluster.

Reference: what the evaluation's processes occupy, counted from the recipe by hand: ``num_engines``
SGLang engines of ``max(tp, ep)`` GPUs each, no trainer rank; and, for training, the trainer world
(``trainer_nodes x trainer_devices_per_node``) plus the same engines.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cluster.bundles import bundle_shapes
from megarl.cluster.placement import with_roles
from megarl.config.loader import load_config

REPO = Path(__file__).resolve().parents[3]


def _counts(cfg):
    tp, ep = int(cfg.rollout.engine.tensor_parallel_size), int(cfg.rollout.engine.expert_parallel_size)
    engine_gpus = int(cfg.rollout.num_engines) * max(tp, ep)
    world = int(cfg.cluster.trainer_nodes) * int(cfg.cluster.trainer_devices_per_node)
    return engine_gpus, world


@pytest.mark.parametrize("recipe", ["deepseek_v3_gpu", "kimi_k2_gpu", "qwen3_30b_a3b_gpu"])
@pytest.mark.parametrize("roles", [False, True])
def test_disaggregated_eval_reserves_the_engines_gpus_only(recipe, roles):
    cfg = load_config(REPO / "configs" / f"{recipe}.yaml")
    engine_gpus, world = _counts(cfg)
    train = bundle_shapes(cfg)
    assert train.gpus() == world + engine_gpus  # training: the trainer world and the engines
    tp, ep = int(cfg.rollout.engine.tensor_parallel_size), int(cfg.rollout.engine.expert_parallel_size)
    assert (train.cuda, train.num_engines, train.devices_per_engine) == (True, cfg.rollout.num_engines, max(tp, ep))
    evaluation = bundle_shapes(cfg, engines_only=True)
    assert evaluation.trainer == []
    assert evaluation.gpus() == engine_gpus
    assert evaluation.rollout == train.rollout  # the engines are placed as in training (node parts included)
    trainer, rollout = with_roles(evaluation, roles)
    assert trainer == [] and len(rollout) == len(evaluation.rollout)
    if roles:
        assert all(b["megarl_rollout"] == b["GPU"] for b in rollout)
        assert all(b["megarl_trainer"] == 1 for b in with_roles(train, roles)[0])
    else:
        assert all(set(b) == {"CPU", "GPU"} for b in rollout)


def test_colocated_eval_reserves_the_engines_devices_only():
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_gpu.yaml",
                      ["cluster.placement=colocated", "cluster.trainer_nodes=2", "rollout.num_engines=2"])
    engine_gpus, world = _counts(cfg)
    assert (engine_gpus, world) == (8, 16)
    assert bundle_shapes(cfg).gpus() == world
    evaluation = bundle_shapes(cfg, engines_only=True)
    assert evaluation.rollout == [] and evaluation.gpus() == engine_gpus


def test_eval_with_external_engines_reserves_nothing():
    cfg = load_config(REPO / "configs" / "deepseek_v3_gpu.yaml", ["rollout.external_engine_urls=[http://h:1]"])
    assert bundle_shapes(cfg, engines_only=True).gpus() == 0
    assert bundle_shapes(cfg).gpus() == _counts(cfg)[1]
