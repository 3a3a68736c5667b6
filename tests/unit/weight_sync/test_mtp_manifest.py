"""A checkpoint with multi-token-prediction layers (DeepSeek-V3, GLM-4.5 releases; the CPU twins' tiny
models with ``mtp_layers=1``): the engines' manifest leaves the MTP layer out, so a plan of the decoder
layers matches it. Before ``mtp_layer_names`` the check refused such a checkpoint ("engine tensor(s) the
plan never sends: model.layers.2...")."""
import json

import pytest
from safetensors import safe_open

from megarl.models.tiny import TinyModelSpec, make_tiny_model
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.manifest_checks import check_plan_against_manifest, mtp_layer_names, read_manifest
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan


def _tensor_names(hf_dir) -> set[str]:
    """Every tensor name in the directory's safetensors files (read by safetensors, not by megarl)."""
    names: set[str] = set()
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            names |= set(fh.keys())
    return names


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_tiny_mtp_layer_is_in_the_checkpoint_but_not_in_the_manifest(family, tmp_path):
    from transformers import AutoConfig

    hf_dir = make_tiny_model(tmp_path / family, TinyModelSpec(family=family, mtp_layers=1))
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    names = _tensor_names(hf_dir)
    mtp = {n for n in names if n.startswith("model.layers.2.")}
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight"} <= mtp
    manifest = read_manifest(hf_dir)
    assert set(manifest) == names - mtp
    specs = param_specs_from_hf_config(AutoConfig.from_pretrained(hf_dir), tensor_model_parallel_size=1,
                                       dtype="float32")
    plan = build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=2), specs, bucket_size_mb=0.25)
    check_plan_against_manifest(plan, manifest)  # raised "... the plan never sends" with the MTP layer kept


def test_mtp_layer_names_reads_the_layer_index_under_any_prefix():
    names = ["model.layers.60.mlp.gate.weight", "model.layers.61.eh_proj.weight", "model.layers.610.x.weight",
             "language_model.model.layers.61.enorm.weight", "model.layers.62.x.weight", "lm_head.weight"]
    assert mtp_layer_names(names, {"num_hidden_layers": 61, "num_nextn_predict_layers": 1}) == {
        "model.layers.61.eh_proj.weight", "language_model.model.layers.61.enorm.weight"}
    assert mtp_layer_names(names, {"num_hidden_layers": 61, "num_nextn_predict_layers": 0}) == set()
    assert mtp_layer_names(names, {"num_hidden_layers": 61}) == set()


def test_mtp_layers_only_where_the_family_has_them(tmp_path):
    with pytest.raises(ValueError, match="mtp_layers"):
        make_tiny_model(tmp_path / "q", TinyModelSpec(family="qwen3_moe", mtp_layers=1))
    with pytest.raises(ValueError, match="mtp_layers"):
        make_tiny_model(tmp_path / "d", TinyModelSpec(family="deepseek_v3", mtp_layers=2))
