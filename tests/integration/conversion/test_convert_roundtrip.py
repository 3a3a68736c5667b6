"""HF -> Megatron dist checkpoint (several layouts, 2 gloo ranks) -> HF is bit-identical.

References: the original safetensors files (read with the safetensors library), the original
config.json, and transformers' forward pass of the original directory.
"""
import json
import os
import shutil

import pytest
import torch

from megarl.conversion.config_check import ConfigMismatchError
from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.conversion.hf_io import CheckpointFileError
from megarl.testing.checkpoints import edited_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

LAYOUTS = {  # name -> (TP, PP, EP, ETP)
    "tp1": (1, 1, 1, None), "tp2": (2, 1, 1, None), "pp2": (1, 2, 1, None), "ep2": (1, 1, 2, None),
    "tp2_ep2_etp1": (2, 1, 2, 1), "pp2_vpp2": (1, 2, 1, None, 2),
}


def _roundtrip(hf_dir, tmp_path, layout, **export_kwargs):
    tp, pp, ep, etp, *vpp = LAYOUTS[layout]
    ckpt = hf_to_megatron(hf_dir, tmp_path / f"ckpt_{layout}", tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                          expert_tensor_parallel_size=etp, virtual_pipeline_model_parallel_size=(vpp or [None])[0],
                          timeout_s=240)
    return megatron_to_hf_dir(ckpt, tmp_path / f"hf_{layout}", timeout_s=240, **export_kwargs)


def _assert_identical(original, exported):
    ref, out = _load_all(original), _load_all(exported)
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    assert json.loads((exported / "config.json").read_text()) == json.loads((original / "config.json").read_text())
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (exported / name).read_bytes() == (original / name).read_bytes(), name


@pytest.fixture(scope="module")
def tiny_tied_dir(tmp_path_factory):
    """Tied embeddings, a vocabulary that Megatron pads (1000 -> 1024 at TP1 and TP2), 4 layers."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_tied",
                           TinyModelSpec(family="qwen3_moe", vocab_size=1000, tie_word_embeddings=True,
                                         num_hidden_layers=4))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "pp2_vpp2"])
@pytest.mark.parametrize("fixture", ["tiny_moe_dir", "tiny_dense_dir"])
def test_roundtrip_bit_identical(fixture, layout, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    if fixture == "tiny_dense_dir" and LAYOUTS[layout][2] > 1:  # EP needs experts
        with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs an MoE model"):
            _roundtrip(hf_dir, tmp_path, layout)
        return
    _assert_identical(hf_dir, _roundtrip(hf_dir, tmp_path, layout))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2", "pp2_vpp2"])
def test_roundtrip_tied_padded_vocab(tiny_tied_dir, layout, tmp_path):
    from megarl.conversion.dist_ckpt import tensor_shapes

    assert json.loads((tiny_tied_dir / "config.json").read_text())["vocab_size"] == 1000
    out = _roundtrip(tiny_tied_dir, tmp_path, layout, max_shard_bytes=200_000)
    emb_shape = tensor_shapes(tmp_path / f"ckpt_{layout}")["embedding.word_embeddings.weight"][0]
    assert emb_shape == (1024, 64)  # padded inside Megatron, removed on export
    assert (out / "model.safetensors.index.json").exists()  # several shards + index
    _assert_identical(tiny_tied_dir, out)


@pytest.mark.timeout(300)
def test_exported_model_gives_same_logprobs(tiny_moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = _roundtrip(tiny_moe_dir, tmp_path, "tp2_ep2_etp1")
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    logprobs = []
    for path in (tiny_moe_dir, out):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logprobs.append(torch.log_softmax(model(tokens).logits[:, -1], dim=-1))
    assert torch.equal(logprobs[0], logprobs[1])



@pytest.mark.timeout(300)
def test_mismatch_and_truncation_write_nothing(tiny_moe_dir, tmp_path):
    bad = edited_hf_dir(tiny_moe_dir, tmp_path / "bad", num_hidden_layers=3)
    with pytest.raises(ConfigMismatchError, match="num_hidden_layers: 3 in .*bad/config.json.* 2 layers"):
        hf_to_megatron(bad, tmp_path / "out1")
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_moe_dir, trunc)
    shard = trunc / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointFileError, match="truncated checkpoint shard .*trunc/model.safetensors"):
        hf_to_megatron(trunc, tmp_path / "out2")
    ckpt = hf_to_megatron(tiny_moe_dir, tmp_path / "ckpt")
    other = edited_hf_dir(tiny_moe_dir, tmp_path / "other", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    with pytest.raises(ConfigMismatchError, match=r"rope_theta: 1000000.0 in .*ckpt/hf_config/config.json vs 10000.0 in .*other/config.json"):
        megatron_to_hf_dir(ckpt, tmp_path / "out3", hf_config_dir=other)
    shutil.rmtree(ckpt / "hf_config")
    wide = edited_hf_dir(tiny_moe_dir, tmp_path / "wide", num_key_value_heads=4)
    with pytest.raises(ConfigMismatchError, match=r"num_key_value_heads: 4 in .*wide/config.json, but the checkpoint .* has 2"):
        megatron_to_hf_dir(ckpt, tmp_path / "out4", hf_config_dir=wide)
    for name in ("out1", "out2", "out3", "out4"):
        assert not (tmp_path / name).exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.timeout(300)
def test_cli_entry_points(tiny_dense_dir, tmp_path):
    import importlib.util
    import pathlib

    tools = pathlib.Path(__file__).resolve().parents[3] / "tools"
    mains = {}
    for name in ("convert_hf_to_megatron", "convert_megatron_to_hf"):
        spec = importlib.util.spec_from_file_location(name, tools / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        mains[name] = module.main
    assert mains["convert_hf_to_megatron"]([str(tiny_dense_dir), str(tmp_path / "ck"), "--pipeline-model-parallel-size", "2"]) == 0
    assert mains["convert_megatron_to_hf"]([str(tmp_path / "ck"), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    ref, out = _load_all(tiny_dense_dir), _load_all(tmp_path / "hf")
    assert all(out[k].dtype == torch.bfloat16 and torch.equal(out[k], ref[k].to(torch.bfloat16)) for k in ref)
