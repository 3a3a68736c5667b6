"""Family config translation (both HF spellings), config checks and streaming safetensors I/O."""
import json
import shutil

import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import (
    ConfigMismatchError,
    check_weights_match_config,
    compare_configs,
    expected_hf_shapes,
)
from megarl.conversion.hf_io import CheckpointFileError, HFCheckpointReader, SafetensorsStreamWriter, plan_shards
from megarl.models.families import get_family
from megarl.testing.checkpoints import edited_hf_dir


def _old_spelling(src, dst):
    """Rewrite a transformers-5 config.json in the transformers-4 spelling."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst



def test_both_spellings_give_the_same_megatron_config(tiny_moe_dir, tmp_path):
    from transformers import AutoConfig

    from megarl.training.model import build_transformer_config

    old = _old_spelling(tiny_moe_dir, tmp_path / "old")
    assert "num_experts" in json.loads((old / "config.json").read_text())
    new_cfg, old_cfg = AutoConfig.from_pretrained(tiny_moe_dir), AutoConfig.from_pretrained(old)
    family = get_family(new_cfg)
    assert family.architecture(new_cfg) == family.architecture(old_cfg)
    compare_configs(new_cfg, old_cfg, expected_file="a", actual_file="b")
    cfg = build_transformer_config(old, ParallelConfig(), ModelConfig())
    raw = json.loads((tiny_moe_dir / "config.json").read_text())
    assert cfg.num_moe_experts == raw["num_local_experts"] and cfg.moe_router_topk == raw["num_experts_per_tok"]
    assert cfg.num_query_groups == raw["num_key_value_heads"] and cfg.kv_channels == raw["head_dim"]
    assert cfg.moe_router_pre_softmax is (not raw["norm_topk_prob"]) and cfg.qk_layernorm
    assert cfg.moe_router_dtype == "fp32" and cfg.moe_aux_loss_coeff == 0.0
    assert cfg.moe_router_load_balancing_type == "none"
    kwargs = family.gpt_model_kwargs(family.architecture(old_cfg))
    assert kwargs["rotary_base"] == raw["rope_parameters"]["rope_theta"]


def test_config_translation_errors(tiny_moe_dir):
    from megarl.training.model import build_transformer_config
    from megarl.training.parallel_state import check_parallel_sizes

    with pytest.raises(ValueError, match="sequence_parallel=True"):
        build_transformer_config(tiny_moe_dir, ParallelConfig(tensor_model_parallel_size=2), ModelConfig())
    with pytest.raises(ValueError, match="num_hidden_layers=2 .* not divisible .* = 4"):
        build_transformer_config(tiny_moe_dir, ParallelConfig(pipeline_model_parallel_size=4), ModelConfig())
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(2\)"):
        check_parallel_sizes(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 2)
    check_parallel_sizes(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                        expert_tensor_parallel_size=1), 2)


@pytest.mark.parametrize("fixture", ["tiny_moe_dir", "tiny_dense_dir"])
def test_expected_shapes_match_real_checkpoint(fixture, request):
    from transformers import AutoConfig

    path = request.getfixturevalue(fixture)
    reader = HFCheckpointReader(path)
    expected = expected_hf_shapes(AutoConfig.from_pretrained(path))
    assert expected == {k: reader.shape(k) for k in reader.keys()}
    check_weights_match_config(path)


def test_config_that_disagrees_with_weights_is_named(tiny_moe_dir, tmp_path):
    bad = edited_hf_dir(tiny_moe_dir, tmp_path / "bad", num_hidden_layers=3)
    with pytest.raises(ConfigMismatchError, match=rf"num_hidden_layers: 3 in {bad}/config.json, .* have 2 layers"):
        check_weights_match_config(bad)
    bad2 = edited_hf_dir(tiny_moe_dir, tmp_path / "bad2", num_key_value_heads=4)
    with pytest.raises(ConfigMismatchError, match="k_proj.weight: shape .*num_key_value_heads"):
        check_weights_match_config(bad2)
    other = edited_hf_dir(tiny_moe_dir, tmp_path / "other", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    from transformers import AutoConfig
    with pytest.raises(ConfigMismatchError, match=r"rope_theta: 1000000.0 in a\.json vs 10000.0 in b\.json"):
        compare_configs(AutoConfig.from_pretrained(tiny_moe_dir), AutoConfig.from_pretrained(other),
                        expected_file="a.json", actual_file="b.json")


def test_stream_writer_and_reader_roundtrip(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7), "c": torch.randn(2, 2, 2)}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    writer = SafetensorsStreamWriter(tmp_path / "x.safetensors", entries)
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", tensors["b"])
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    ref = load_file(tmp_path / "x.safetensors")  # the safetensors library is the reference reader
    assert all(torch.equal(ref[k], v) for k, v in tensors.items())
    (tmp_path / "x.safetensors").rename(tmp_path / "model.safetensors")
    reader = HFCheckpointReader(tmp_path)
    assert all(torch.equal(reader.get(k), v) and reader.get(k).dtype == v.dtype for k, v in tensors.items())
    assert [len(s) for s in plan_shards(entries, 90)] == [2, 1]  # 30 + 56 bytes, then 32


def test_truncated_and_missing_shards(tiny_dense_dir, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_dense_dir, bad)
    path = bad / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointFileError, match=f"truncated checkpoint shard {path}"):
        HFCheckpointReader(bad)
    path.unlink()
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointFileError, match="missing checkpoint shard: .*model-00001-of-00002"):
        HFCheckpointReader(bad)
