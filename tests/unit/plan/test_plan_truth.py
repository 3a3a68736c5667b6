"""`megarl plan` tells the truth (issue 35 item 5): logits under sequence parallelism, the engine's
concurrency against its KV pool, GPU presets in the cards' units, shipped GPU recipes that name
their GPU and fit it, refusal hints checked against the config, ``--suggest`` overrides that paste back.

References: a second layout (the same TP without sequence parallelism: Megatron-Core's output layer
all-gathers the SP input, so the logits are the same size), SGLang's pool formula written out
(``mem_fraction_static x memory - weights`` over the KV bytes per token), the cards' datasheet units.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoConfig

from megarl.config import load_config, validate
from megarl.config.device import resolved_precision
from megarl.config.model_rules import read_hf_config
from megarl.config.validate import fit_issues
from megarl.plan.fit import fit_problems, plan_fit
from megarl.plan.gpus import GPUS, gpu_spec
from megarl.plan.memory import TrainerSetup, trainer_rank_memory
from megarl.plan.shape import ModelShape

REPO = Path(__file__).resolve().parents[3]
RECIPE_235B = str(REPO / "configs" / "qwen3_235b_a22b_gpu.yaml")
GSM8K = str(REPO / "examples" / "gsm8k_tool" / "gsm8k_tool.yaml")


def gpu_recipes() -> list[Path]:
    """Every shipped YAML whose cluster runs on CUDA (configs/*_gpu.yaml, examples/*/*.yaml)."""
    out = []
    for path in sorted([*REPO.glob("configs/*.yaml"), *REPO.glob("examples/*/*.yaml")]):
        cfg = load_config(str(path), [])
        if cfg.cluster.device == "cuda" or path.stem.endswith("_gpu"):
            out.append(path)
    return out


def test_the_gpu_recipes_are_found():
    names = {p.name for p in gpu_recipes()}
    assert {"deepseek_v3_gpu.yaml", "qwen3_30b_a3b_gpu.yaml", "search_r1_gpu.yaml", "gsm8k_tool.yaml"} <= names
    assert "arithmetic_tool.yaml" not in names and "cpu_gsm8k.yaml" not in names


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", gpu_recipes(), ids=lambda p: p.name)
def test_every_gpu_recipe_names_its_gpu_and_fits_it(recipe):
    cfg = load_config(str(recipe), [])
    assert cfg.cluster.gpu in GPUS, f"{recipe.name}: cluster.gpu is {cfg.cluster.gpu!r}"
    hf = read_hf_config(cfg.model.hf_path)
    precision = resolved_precision(cfg)
    fit = plan_fit(cfg, hf, gpu_spec(cfg.cluster.gpu), precision=precision)
    assert fit.trainer_fits and fit.engine_fits, (fit.trainer.total, fit.sequences_fit, fit.concurrency)
    assert fit_problems(cfg, hf, gpu_spec(cfg.cluster.gpu), precision=precision) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", gpu_recipes(), ids=lambda p: p.name)
def test_every_gpu_recipe_validates_with_its_gpu(recipe):
    validate(load_config(str(recipe), []))  # with the fit check: cluster.gpu is set


@pytest.mark.parametrize("name, tp, cp", [("qwen3-235b-a22b", 4, 1), ("deepseek-v3", 8, 2)])
def test_logits_under_sequence_parallelism_are_all_tokens_by_the_vocab_slice(name, tp, cp):
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(REPO / "configs" / "models" / name))
    base = dict(world_size=tp * cp * 2, tp=tp, cp=cp, tokens_per_microbatch=16384)
    sp = trainer_rank_memory(shape, TrainerSetup(**base, sequence_parallel=True), 0).consumers["logits"]
    no_sp = trainer_rank_memory(shape, TrainerSetup(**base, sequence_parallel=False), 0).consumers["logits"]
    assert sp == no_sp == int(16384 / cp * shape.padded_vocab(128, tp) / tp * 6)


def test_presets_are_in_the_cards_units():
    assert GPUS["h100"].memory_bytes == 80 * 2 ** 30 and GPUS["h100"].memory_text == "80 GiB"
    assert GPUS["h200"].memory_bytes == 141 * 10 ** 9 and GPUS["h200"].memory_text == "141 GB"
    assert GPUS["gb200"].gpus_per_node == 4 and GPUS["h100"].gpus_per_node == 8


@pytest.mark.timeout(120)
def test_gb200_nodes_have_four_gpus():
    cfg = load_config(RECIPE_235B, ["cluster.gpu=gb200"])
    problems = dict(fit_problems(cfg, read_hf_config(cfg.model.hf_path), GPUS["gb200"], precision="bf16"))
    assert "a gb200 node has 4" in problems["cluster.trainer_devices_per_node"]


@pytest.mark.timeout(120)
def test_the_engine_must_hold_what_it_serves_at_once():
    """Qwen3-235B on H100 without the recipe's --max-running-requests: 64 x 8 trajectories over 4
    engines = 128 at once, at 12,288 tokens each; SGLang's pool formula says how many fit."""
    cfg = load_config(RECIPE_235B, ["rollout.engine.extra_args=[]"])
    hf = read_hf_config(cfg.model.hf_path)
    fit = plan_fit(cfg, hf, GPUS["h100"], precision="bf16")
    pool_tokens = (int(0.8 * 80 * 2 ** 30) - fit.engine.weights) // fit.engine.kv_per_token
    assert fit.concurrency == 64 * 8 // 4
    assert fit.sequences_fit == pool_tokens // 12288 < 128 and not fit.engine_fits
    (issue,) = [i for i in fit_issues(cfg) if i.key == "rollout.engine.tensor_parallel_size"]
    assert f"{fit.sequences_fit} sequence(s)" in issue.message and "the 128 it serves at once" in issue.message
    assert f'"--max-running-requests","{fit.sequences_fit}"' in issue.message
    capped = load_config(RECIPE_235B, [f"rollout.engine.extra_args=[--max-running-requests,{fit.sequences_fit}]"])
    assert plan_fit(capped, hf, GPUS["h100"], precision="bf16").engine_fits


@pytest.mark.timeout(120)
def test_hints_are_checked_against_the_config():
    old_gsm8k = load_config(GSM8K, ["parallel.tensor_model_parallel_size=2", "train.max_tokens_per_microbatch=16384"])
    problems = dict(fit_problems(old_gsm8k, read_hf_config(old_gsm8k.model.hf_path), GPUS["h100"], precision="bf16"))
    (message,) = problems.values()
    assert old_gsm8k.parallel.use_distributed_optimizer and "use_distributed_optimizer=true" not in message
    assert "cannot shard further" in message
    fp8 = load_config(str(REPO / "configs" / "deepseek_v3_gpu.yaml"), ["rollout.engine.extra_args=[]"])
    problems = dict(fit_problems(fp8, read_hf_config(fp8.model.hf_path), GPUS["h200"], precision="bf16"))
    assert "block-FP8" not in problems["rollout.engine.tensor_parallel_size"]
    from megarl.config.parallel import parallel_size_issues

    p = OmegaConf.create({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                          "context_parallel_size": 1, "expert_model_parallel_size": 3,
                          "expert_tensor_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                          "sequence_parallel": True})
    ((_, text),) = parallel_size_issues(p, 8, "8")
    assert "defaults to TP" not in text


@pytest.mark.timeout(300)
def test_suggest_prints_overrides_that_paste_back(capsys):
    from megarl.cli import main

    main(["plan", RECIPE_235B, "--no-sync", "--suggest"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("suggest trainer", "suggest engines"))]
    assert len(lines) == 2, lines
    overrides = [o for line in lines for o in line.split("): ", 1)[1].split()]
    assert overrides and all(re.fullmatch(r"[a-z_]+(\.[a-z_]+)+=\S+", o) for o in overrides), overrides
    cfg = load_config(RECIPE_235B, overrides)
    for o in overrides:
        key, value = o.split("=", 1)
        assert str(OmegaConf.select(cfg, key, throw_on_missing=True)).lower() == ("none" if value == "null" else value)
