"""megarl validate: GPU-run settings and cross-feature conflicts, each error naming its key (issue 18)."""
import pytest
from config_issues import validate_issues

_issues = validate_issues


def test_fp8_delayed_recipe_rejected_with_gspo(good_overrides):
    issues = _issues(good_overrides + ["train.fp8=e4m3", "train.fp8_recipe=delayed"])
    assert "train.fp8_recipe" in issues and "GSPO" in issues["train.fp8_recipe"]
    assert "train.fp8_recipe" not in _issues(good_overrides + ["train.fp8=e4m3", "train.fp8_recipe=tensorwise"])
    assert "train.fp8_recipe" not in _issues(good_overrides + ["train.fp8=e4m3", "train.fp8_recipe=delayed",
                                                     "algorithm.policy_loss=ppo_clip", "algorithm.clip_low=0.2",
                                                     "algorithm.clip_high=0.28"])


def test_fp8_recipe_checked_against_the_visible_gpu(good_overrides, monkeypatch):
    """Where a GPU is visible validate asks fp8_support_error about it (here: an emulated A100)."""
    import torch

    from megarl.training import fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(fp8, "installed_te_version", lambda: "2.9.0")
    issues = _issues(good_overrides + ["cluster.device=cuda", "train.precision=bf16", "train.fp8=e4m3"])
    assert "train.fp8_recipe" in issues and "8.9 or higher" in issues["train.fp8_recipe"]


def test_megatron_overrides_checked_against_megatron_dataclasses(good_overrides):
    ok = _issues(good_overrides + ["model.megatron_overrides={moe_permute_fusion: false, bucket_size: 1000000}"])
    assert not [k for k in ok if k.startswith("model.megatron_overrides")], ok
    bad = _issues(good_overrides + ["model.megatron_overrides={moe_permute_fusoin: false, tensor_model_parallel_size: 2}"])
    assert "not a field" in bad["model.megatron_overrides.moe_permute_fusoin"]
    assert "parallel.tensor_model_parallel_size" in bad["model.megatron_overrides.tensor_model_parallel_size"]


def test_uneven_pipeline_stages(good_overrides, tmp_path):
    """A 5-layer model on PP=2 (not divisible) is valid with first=2 / last=3; each bad split names its key."""
    from megarl.models.tiny import TinyModelSpec, _hf_config

    hf_config = _hf_config(TinyModelSpec(family="qwen3_moe", num_hidden_layers=5), 2048, 0, 1)[0]
    hf_config.save_pretrained(tmp_path)
    pp2 = [o for o in good_overrides if not o.startswith(("model.hf_path", "parallel.expert_model"))] + [
        f"model.hf_path={tmp_path}", "parallel.pipeline_model_parallel_size=2"]
    assert "parallel.pipeline_model_parallel_size" in _issues(pp2)  # 5 layers, PP=2, even split
    assert _issues(pp2 + ["parallel.num_layers_in_first_pipeline_stage=2"]) == {}
    assert _issues(pp2 + ["parallel.num_layers_in_last_pipeline_stage=3"]) == {}
    assert "parallel.num_layers_in_first_pipeline_stage" in _issues(
        pp2 + ["parallel.num_layers_in_first_pipeline_stage=2", "parallel.num_layers_in_last_pipeline_stage=2"])
    assert "parallel.num_layers_in_first_pipeline_stage" in _issues(
        pp2 + ["parallel.num_layers_in_first_pipeline_stage=5"])  # nothing left for the last stage


def test_uneven_pipeline_stages_build_megatrons_layer_assignment():
    """The Megatron config megarl builds assigns layers as Megatron's own offset function says
    (DeepSeek-V3's 61 layers on PP=8 with first 7 / last 6), and the divisibility check is lifted."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.models.tiny import TinyModelSpec, _hf_config
    from megarl.training.model import build_transformer_config

    hf_config = _hf_config(TinyModelSpec(family="qwen3", num_hidden_layers=61), 2048, 0, 1)[0]
    par = ParallelConfig(pipeline_model_parallel_size=8, num_layers_in_first_pipeline_stage=7,
                         num_layers_in_last_pipeline_stage=6)
    cfg = build_transformer_config(hf_config, par, ModelConfig(), device="meta")
    sizes = [get_num_layers_to_build(cfg, None, pp) for pp in range(8)]
    offsets = [get_transformer_layer_offset(cfg, None, pp) for pp in range(8)]
    assert sizes == [7, 8, 8, 8, 8, 8, 8, 6] and offsets == [0, 7, 15, 23, 31, 39, 47, 55]
    with pytest.raises(ValueError, match="not divisible"):
        build_transformer_config(hf_config, ParallelConfig(pipeline_model_parallel_size=8), ModelConfig(),
                                 device="meta")


def test_cross_feature_conflicts(good_overrides):
    assert "rollout.engine.expert_parallel_size" in _issues(
        good_overrides + ["rollout.engine.tensor_parallel_size=2", "rollout.engine.expert_parallel_size=4",
                "cluster.rollout_devices_per_node=2"])
    assert "model.moe_grouped_gemm" in _issues(good_overrides + ["model.moe_grouped_gemm=true"])
    assert "rollout.engine.expert_parallel_size" in _issues(
        good_overrides + ["rollout.engine.tensor_parallel_size=3", "rollout.engine.expert_parallel_size=3",
                "cluster.rollout_devices_per_node=3"])  # 8 experts not divisible by engine EP 3


def test_engines_fit_and_pack_per_node(good_overrides):
    # 2 nodes x 4 devices, engine TP 3: one engine per node (the 4th device idles), so at most 2
    two_nodes = good_overrides + ["cluster.rollout_nodes=2", "cluster.rollout_devices_per_node=4",
                        "rollout.engine.tensor_parallel_size=1"]
    assert _issues(two_nodes + ["rollout.num_engines=8"]) == {}
    issues = _issues(two_nodes + ["rollout.num_engines=8", "rollout.engine.tensor_parallel_size=2"])
    assert "rollout.num_engines" in issues  # 8 x TP2 = 16 devices > 8
    # an engine larger than a node spans whole nodes (issue 25 part 4: tests/unit/config/test_validate_engine_nodes.py)
    issues = _issues(good_overrides + ["cluster.rollout_nodes=2", "cluster.rollout_devices_per_node=3",
                             "rollout.engine.tensor_parallel_size=4", "rollout.num_engines=1"])
    assert "partial node" in issues["rollout.engine.tensor_parallel_size"]
