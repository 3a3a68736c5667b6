"""``megarl validate``'s fit check and ``megarl plan``'s exit status on the shipped recipes.

What must be refused follows from arithmetic on the checkpoints' sizes: DeepSeek-V3 is 671e9
parameters, 1342 GB in BF16, 168 GB per GPU of one 8-GPU engine (an H100 has 80 GB); Qwen3-30B-A3B's
routed experts are 29e9 parameters, 6 B each for weights and FP32 gradients on every rank of a
stage at EP 1: 87 GB per rank at PP 2 before any optimizer state.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[3]
RECIPE_30B = str(REPO / "configs" / "qwen3_30b_a3b_gpu.yaml")


def _validate(recipe: str, *overrides: str):
    return validate(load_config(recipe, list(overrides)))


@pytest.mark.timeout(120)
def test_the_30b_recipe_fits_an_h100():
    _validate(RECIPE_30B, "cluster.gpu=h100")


@pytest.mark.timeout(120)
def test_experts_unsharded_over_ep_are_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        _validate(RECIPE_30B, "cluster.gpu=h100", "parallel.expert_model_parallel_size=1")
    (issue,) = err.value.issues
    assert issue.key == "parallel.expert_model_parallel_size"
    assert "largest: gradients" in issue.message and "80 GiB of cluster.gpu=h100" in issue.message


@pytest.mark.timeout(120)
def test_deepseek_v3_bf16_on_one_h100_node_engine_is_refused():
    with pytest.raises(ConfigError) as err:
        _validate(RECIPE_30B, "cluster.gpu=h100", f"model.hf_path={REPO}/configs/models/deepseek-v3",
                  "parallel.pipeline_model_parallel_size=1", "parallel.expert_model_parallel_size=32",
                  "rollout.engine.tensor_parallel_size=8", "rollout.num_engines=2")
    keys = [issue.key for issue in err.value.issues]
    assert "rollout.engine.tensor_parallel_size" in keys


@pytest.mark.timeout(120)
def test_cpu_runs_skip_the_check_and_unknown_gpus_are_named():
    _validate(RECIPE_30B, "cluster.gpu=h100", "cluster.device=cpu", "parallel.expert_model_parallel_size=1",
              "train.precision=fp32", "train.fp8=null", "model.moe_grouped_gemm=false")
    with pytest.raises(ConfigError) as err:
        _validate(RECIPE_30B, "cluster.gpu=a100")
    assert [issue.key for issue in err.value.issues] == ["cluster.gpu"]


@pytest.mark.timeout(300)
def test_plan_exit_status_says_whether_it_fits(capsys):
    from megarl.cli import main

    recipe = str(REPO / "configs" / "deepseek_v3_gpu.yaml")
    assert main(["plan", recipe, "--no-sync"]) == 0
    out = capsys.readouterr().out
    assert "block FP8 weights" in out and "DOES NOT FIT" not in out
    assert main(["plan", recipe, "--no-sync", "--gpu", "h100"]) == 1  # 85 GB of FP8 weights per GPU
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_suggested_layout_validates_and_one_node_less_does_not_fit():
    """``--suggest``'s trainer layout passes ``megarl validate`` (Megatron's divisibility rules and
    the fit check); when it needs more than one node, on one node fewer no layout of the searched
    space fits (the planner's memory for every TP / PP / EP there; the 30B recipe fits one node)."""
    from transformers import AutoConfig

    from megarl.plan.fit import suggest_trainer
    from megarl.plan.gpus import GPUS
    from megarl.plan.memory import TrainerSetup, trainer_memory
    from megarl.plan.shape import ModelShape

    cfg = load_config(RECIPE_30B, ["cluster.gpu=h100"])
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(REPO / "configs" / "models" / "qwen3-30b-a3b"))
    base = TrainerSetup.from_config(cfg, precision="bf16")
    nodes, layout, _ = suggest_trainer(shape, base, GPUS["h100"], 8)
    _validate(RECIPE_30B, "cluster.gpu=h100", f"cluster.trainer_nodes={nodes}",
              f"parallel.tensor_model_parallel_size={layout.tp}", f"parallel.pipeline_model_parallel_size={layout.pp}",
              f"parallel.expert_model_parallel_size={layout.ep}", "parallel.expert_tensor_parallel_size=1",
              f"parallel.sequence_parallel={layout.tp > 1}", f"train.global_batch_size={8 * layout.dp}")
    if nodes > 1:
        world = (nodes - 1) * 8
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8, 16):
                for ep in (1, 2, 4, 8, 16, 32, 64, 128):
                    if world % (tp * pp) or (world // pp) % ep:
                        continue
                    smaller = TrainerSetup(**{**base.__dict__, "world_size": world, "tp": tp, "pp": pp, "ep": ep,
                                              "etp": 1, "num_layers_first": None, "num_layers_last": None})
                    assert trainer_memory(shape, smaller).total > GPUS["h100"].memory_bytes
