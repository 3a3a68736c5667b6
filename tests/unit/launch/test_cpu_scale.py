"""`megarl.launch.cpu_scale`: every recipe scales to a valid one-host CPU config that keeps its features."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.config import load_config, validate
from megarl.launch.cpu_scale import ENGINE_TP2_FAMILIES, cpu_scale
from megarl.models.tiny import resolve_model_path

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted(p.relative_to(REPO).as_posix() for pattern in ("configs/*.yaml", "examples/*/*.yaml")
                 for p in REPO.glob(pattern))
KEPT = ("train.routing_replay", "model.recompute_granularity", "rollout.async_mode", "rollout.max_staleness",
        "rollout.partial_rollouts", "rollout.deterministic_sampling", "weight_sync.transport", "weight_sync.verify",
        "cluster.placement", "algorithm.policy_loss", "algorithm.rollout_correction", "rollout.agent.name",
        "rollout.reward", "rollout.tools", "plugins", "parallel.sequence_parallel")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_scales_to_a_valid_cpu_config_keeping_its_features(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(REPO)
    cfg = load_config(str(REPO / recipe), [])
    before = OmegaConf.to_yaml(cfg)
    scaled, notes = cpu_scale(cfg)
    assert OmegaConf.to_yaml(cfg) == before, "the recipe's config is not modified"
    family = str(scaled.model.hf_path).removeprefix("tiny:").partition("?")[0]
    scaled.model.hf_path = resolve_model_path(scaled.model.hf_path)
    validate(scaled)  # raises ConfigError naming every problem
    c, p = scaled.cluster, scaled.parallel
    assert (c.device, c.trainer_nodes * c.trainer_devices_per_node, scaled.rollout.num_engines) == ("cpu", 2, 1)
    assert p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size <= 2
    # engine TP > 1 is kept (two CPU ranks, as many rollout devices) where the family's TP 2 CPU engine is
    # verified, else dropped with a note
    engine_tp, noted = scaled.rollout.engine.tensor_parallel_size, any("engine.tensor_parallel_size" in n for n in notes)
    kept = cfg.rollout.engine.tensor_parallel_size > 1 and family in ENGINE_TP2_FAMILIES
    assert (engine_tp, c.rollout_devices_per_node) == ((2, 2) if kept else (1, 1)), engine_tp
    assert noted == (cfg.rollout.engine.tensor_parallel_size > 1 and not kept), notes
    for key in KEPT:
        if key == "parallel.sequence_parallel" and cfg.parallel.tensor_model_parallel_size == 1:
            continue
        assert OmegaConf.select(scaled, key) == OmegaConf.select(cfg, key), key
    # what is switched off is said, one line each
    assert scaled.train.fp8 is None and (cfg.train.fp8 is None or any("train.fp8" in n for n in notes))
    assert not scaled.model.moe_grouped_gemm and (not cfg.model.moe_grouped_gemm
                                                  or any("moe_grouped_gemm" in n for n in notes))
    if cfg.parallel.tensor_model_parallel_size > 1:
        assert p.tensor_model_parallel_size == 2
        if cfg.parallel.pipeline_model_parallel_size > 1:
            assert any("pipeline_model_parallel_size" in n for n in notes)
    elif cfg.parallel.pipeline_model_parallel_size > 1:
        assert p.pipeline_model_parallel_size == 2
    if cfg.parallel.expert_model_parallel_size > 1:
        assert p.expert_model_parallel_size == 2
    assert all(n.startswith("cpu-scale: ") for n in notes)


def test_recipe_model_family_is_kept(tmp_path):
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "deepseek_v3"}')
    cfg = load_config(str(REPO / "configs/qwen3_30b_a3b_gpu.yaml"), [f"model.hf_path={hf}"])
    assert cpu_scale(cfg)[0].model.hf_path == "tiny:deepseek_v3"
    (hf / "config.json").write_text('{"model_type": "llama4"}')
    with pytest.raises(ValueError, match="model_type 'llama4'"):
        cpu_scale(cfg)
