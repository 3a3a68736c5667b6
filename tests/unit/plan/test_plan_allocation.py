"""From a recipe to a Slurm job: ``megarl plan``'s allocation and ``sbatch`` line, what fits in a smaller
allocation (``MEGARL_ALLOC_NODES``), and the README's table of recipes.

References: the nodes are the recipe YAML's own ``cluster`` numbers (read with PyYAML, not the
loader), the GPUs per node the preset's; a suggested layout is checked by the validator itself (the
suggestion, pasted back, validates in that allocation, memory fit included; one node fewer does not).
"""
from __future__ import annotations

import re
import shlex
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, load_config, validate
from megarl.config.checker import Checker
from megarl.config.cluster_rules import check_engine_packing
from megarl.plan.allocation import engines_on
from megarl.plan.commands import allocation_lines
from megarl.plan.gpus import GPUS, gpu_spec

REPO = Path(__file__).resolve().parents[3]
RECIPE_30B = "configs/qwen3_30b_a3b_gpu.yaml"


def gpu_recipes() -> list[str]:
    """Every shipped recipe that names a ``cluster.gpu`` (configs/*_gpu.yaml and the examples), repo-relative."""
    paths = sorted([*REPO.glob("configs/*.yaml"), *REPO.glob("examples/*/*.yaml")])
    return [str(p.relative_to(REPO)) for p in paths if load_config(str(p), []).cluster.gpu]


def yaml_nodes(recipe: str) -> int:
    """trainer_nodes + rollout_nodes as the YAML file (or the file it extends) writes them (rollout_nodes
    when disaggregated, the loader's placement: the schema's default when the file names none)."""
    path = REPO / recipe
    raw = yaml.safe_load(path.read_text())
    while "cluster" not in raw:
        path = (path.parent / raw["extends"]).resolve()
        raw = yaml.safe_load(path.read_text())
    cl = raw["cluster"]
    disaggregated = load_config(str(REPO / recipe), []).cluster.placement == "disaggregated"
    return cl["trainer_nodes"] + (cl["rollout_nodes"] if disaggregated else 0)


def test_every_gpu_recipe_is_found():
    recipes = gpu_recipes()
    assert {f"configs/{n}_gpu.yaml" for n in ("qwen3_30b_a3b", "qwen3_235b_a22b", "glm45", "deepseek_v3", "kimi_k2")} \
        <= set(recipes)
    assert "examples/search_r1/search_r1_gpu.yaml" in recipes and "configs/cpu_gsm8k.yaml" not in recipes


@pytest.mark.timeout(120)
def test_plan_prints_the_allocation_and_the_sbatch_line(capsys):
    from megarl.cli import main

    override = "logging.run_dir=runs/my run"
    main(["plan", str(REPO / RECIPE_30B), "--no-sync", "--gpu", "gb200", override])
    out = capsys.readouterr().out
    line = next(s.strip() for s in out.splitlines() if s.strip().startswith("sbatch "))
    words = shlex.split(line)
    assert words[:4] == ["sbatch", f"--nodes={yaml_nodes(RECIPE_30B)}", "--gpus-per-node=4", "slurm/train.sbatch"]
    assert words[4:] == [str(REPO / RECIPE_30B), override, "cluster.gpu=gb200"]
    assert (REPO / words[3]).is_file()


@pytest.mark.parametrize("tp,per_node", [(1, 8), (2, 8), (4, 8), (8, 8), (3, 8), (16, 8), (12, 8), (8, 4)])
def test_engines_on_is_what_the_packing_rule_accepts(tp, per_node):
    for nodes in (1, 2, 3, 4):
        most = engines_on(nodes, tp, per_node)
        for engines, ok in ((most, True), (most + 1, False)):
            if engines < 1:
                continue
            cfg = load_config(str(REPO / RECIPE_30B), [
                f"cluster.rollout_nodes={nodes}", f"cluster.rollout_devices_per_node={per_node}",
                f"rollout.engine.tensor_parallel_size={tp}", f"rollout.num_engines={engines}"])
            c = Checker(cfg)
            check_engine_packing(c)
            assert (not c.issues) == ok, (nodes, tp, per_node, engines, c.issues)


def _alloc_issue(recipe: str, nodes: int, monkeypatch, *overrides: str) -> str | None:
    monkeypatch.setenv("MEGARL_ALLOC_NODES", str(nodes))
    try:
        validate(load_config(str(REPO / recipe), list(overrides)))
    except ConfigError as err:
        return " | ".join(i.message for i in err.issues)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", [RECIPE_30B, "configs/deepseek_v3_gpu.yaml", "configs/kimi_k2_gpu.yaml"])
def test_a_smaller_allocation_names_a_layout_that_validates_there(recipe, monkeypatch):
    need = yaml_nodes(recipe)
    trainer = load_config(str(REPO / recipe), []).cluster.trainer_nodes
    message = _alloc_issue(recipe, need - 1, monkeypatch)
    assert f"the allocation has {need - 1}" in message and "fits in" in message, message
    overrides = re.search(r"(cluster\.rollout_nodes=\d+ rollout\.num_engines=\d+)$", message).group(1).split()
    assert _alloc_issue(recipe, need - 1, monkeypatch, *overrides) is None

    message = _alloc_issue(recipe, trainer, monkeypatch)
    assert "nothing fits" in message, message
    fewest = int(re.search(r"the fewest nodes this recipe runs on are (\d+)", message).group(1))
    overrides = re.search(r"(cluster\.rollout_nodes=\d+ rollout\.num_engines=\d+)$", message).group(1).split()
    assert _alloc_issue(recipe, fewest, monkeypatch, *overrides) is None
    rollout = int(overrides[0].split("=")[1])
    assert _alloc_issue(recipe, fewest - 1, monkeypatch, f"cluster.rollout_nodes={rollout - 1}",
                        "rollout.num_engines=1") is not None


def readme_table() -> dict[str, tuple[str, str, str]]:
    """The README's recipe -> (GPU, nodes, command) table (header ``| recipe | GPU | nodes | command |``)."""
    text = (REPO / "README.md").read_text()
    start = text.index("| recipe | GPU | nodes | command |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        recipe, gpu, nodes, command = (cell.strip().strip("`") for cell in line.strip("|").split("|"))
        rows[recipe] = (gpu, nodes, command)
    return rows


@pytest.mark.timeout(120)
def test_the_readme_table_is_what_plan_prints():
    rows = readme_table()
    assert sorted(rows) == gpu_recipes()
    for recipe, (gpu_cell, nodes_cell, command) in rows.items():
        cfg = load_config(str(REPO / recipe), [])
        gpu = gpu_spec(cfg.cluster.gpu)
        head, sbatch = allocation_lines(Namespace(config=recipe, overrides=[], gpu=None), cfg, gpu)
        assert command == sbatch.strip(), recipe
        assert gpu_cell == f"{gpu.name} x {GPUS[gpu.name].gpus_per_node}", recipe
        total, trainer, rollout = re.fullmatch(r"(\d+) \((\d+) \+ (\d+)\)", nodes_cell).groups()
        assert int(total) == yaml_nodes(recipe) == int(trainer) + int(rollout), recipe
        assert head.startswith(f"allocation: {total} node(s) ({trainer} trainer + {rollout} rollout)"), recipe
