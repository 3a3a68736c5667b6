"""Each GPU recipe's `--cpu-scale` twin keeps the recipe's structural features (issue 34, part 4), or a
``cpu-scale:`` line names the field of every feature it changes."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.launch.preflight import prepare_config
from megarl.launch.twin_features import FIELDS, structural_features

REPO = Path(__file__).resolve().parents[3]
MAY_DIFFER = {"one_expert_data_parallel_copy", "engine_tp_above_1"}
"""Features a twin may change with a ``cpu-scale:`` note: its two CPU ranks with EP 2 hold one copy of each
expert shard where the recipe's layout keeps several; engine TP 1 for a family whose TP 2 CPU engine is not
verified (``megarl.launch.cpu_scale.ENGINE_TP2_FAMILIES``)."""
GPU_RECIPES = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("configs/*_gpu.yaml"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_twin_differs_from_its_recipe_only_where_a_note_says(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEGARL_MODEL_DIR", raising=False)
    monkeypatch.chdir(REPO)
    gpu = structural_features(prepare_config(recipe, []))
    capsys.readouterr()
    twin = structural_features(prepare_config(recipe, [], cpu_scale=True))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cpu-scale:")]
    assert gpu.keys() == twin.keys() == FIELDS.keys()
    unnamed = {name: (gpu[name], twin[name]) for name in FIELDS
               if gpu[name] != twin[name] and not any(FIELDS[name] in note for note in notes)}
    assert not unnamed, f"{recipe}: the twin changes {unnamed} (recipe, twin) without a cpu-scale: note"
    # what every twin keeps, note or not (issue 34 part 4): only MAY_DIFFER may differ, named
    dropped = {name: (gpu[name], twin[name]) for name in FIELDS if name not in MAY_DIFFER and gpu[name] != twin[name]}
    assert not dropped, f"{recipe}: the twin drops {dropped} (recipe, twin), which every twin keeps"


def test_features_read_the_recipe_model(monkeypatch):
    """Independent reference: the values in configs/models/deepseek-v3-fp8/config.json and the recipe."""
    monkeypatch.delenv("MEGARL_MODEL_DIR", raising=False)
    monkeypatch.chdir(REPO)
    features = structural_features(prepare_config("configs/deepseek_v3_gpu.yaml", [], check_fit=False))
    assert features == {
        "model_type": "deepseek_v3", "mla_q_lora_rank": True, "dense_first_layers": True, "shared_experts": True,
        "mtp_layers": 1, "engine_tp_above_1": True, "engine_block_fp8": True,
        "one_expert_data_parallel_copy": True,  # 128 ranks / (ETP 1 * EP 128 * PP 1)
        "several_buckets_per_stage": True}
