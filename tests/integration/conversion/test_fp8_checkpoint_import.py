"""A block-FP8 HF checkpoint (DeepSeek-V3's official release layout: float8_e4m3fn linears, float32
``_scale_inv`` per block, a ``quantization_config``, indexed shards) is read, converted and exported
as the checkpoint its dequantisation stands for.

Reference: the same tiny model with every quantised weight replaced by its dequantisation computed
by the per-block loop of ``tests/unit/models/test_fp8_blocks.py`` (written to disk unquantised).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megarl.conversion.hf_io import CheckpointFileError, HFCheckpointReader
from megarl.models.fp8_blocks import BlockFP8, quantize_blockwise
from megarl.testing.checkpoints import load_safetensors_dir

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "models"))
from test_fp8_blocks import _reference_dequantize

BLOCK = (16, 16)  # the tiny model's linears span several blocks (DeepSeek-V3: 128 x 128)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                       "activation_scheme": "dynamic"}


def _copy_metadata(src: Path, dst: Path, quantized: bool) -> None:
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".index.json")):
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    if quantized:
        config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def fp8_and_reference(tiny_deepseek_v3_dir, tmp_path_factory):
    """``(fp8_dir, reference_dir, quantised names)``."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, ref_dir = root / "fp8", root / "reference"
    _copy_metadata(tiny_deepseek_v3_dir, fp8_dir, quantized=True)
    _copy_metadata(tiny_deepseek_v3_dir, ref_dir, quantized=False)
    original = load_safetensors_dir(tiny_deepseek_v3_dir)
    quantization = BlockFP8(block=BLOCK)
    stored, reference, quantized = {}, {}, []
    for name, tensor in original.items():
        if quantization.is_quantized(name, tensor.shape):
            q, scale_inv = quantize_blockwise(tensor, BLOCK)
            stored[name], stored[name + "_scale_inv"] = q, scale_inv
            reference[name] = _reference_dequantize(q, scale_inv, *BLOCK).to(tensor.dtype)
            quantized.append(name)
        else:
            stored[name] = reference[name] = tensor
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():  # a weight and its scale may live in different shards
        save_file({n: stored[n].contiguous() for n in members}, str(fp8_dir / file))
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, members in shards.items() for n in members}}))
    save_file({n: t.contiguous() for n, t in reference.items()}, str(ref_dir / "model.safetensors"))
    assert len(quantized) > 10 and any(".experts." in n for n in quantized)
    return fp8_dir, ref_dir, quantized


def test_reader_returns_the_dequantised_weights_and_hides_the_scales(fp8_and_reference):
    from megarl.conversion.config_check import check_weights_match_config

    fp8_dir, ref_dir, quantized = fp8_and_reference
    reader, ref = HFCheckpointReader(fp8_dir), HFCheckpointReader(ref_dir)
    assert sorted(reader.keys()) == sorted(ref.keys())
    for name in ref.keys():
        got, want = reader.get(name), ref.get(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert reader.dequantizes(name) == (name in quantized)
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" not in reader
    check_weights_match_config(fp8_dir)  # the family accepts the block-FP8 config


def test_fp8_weights_without_their_scales_or_config_are_refused(fp8_and_reference, tmp_path):
    from safetensors.torch import save_file

    fp8_dir, _, quantized = fp8_and_reference
    broken = tmp_path / "broken"
    shutil.copytree(fp8_dir, broken)
    (broken / "model.safetensors.index.json").unlink()
    for file in broken.glob("model-*.safetensors"):
        file.unlink()
    tensors = load_safetensors_dir(fp8_dir)
    scale = quantized[0] + "_scale_inv"
    save_file({n: t for n, t in tensors.items() if n != scale}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointFileError, match=f"FP8 weight {quantized[0]} has no {scale}"):
        HFCheckpointReader(broken)
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFileError, match="float8_e4m3fn tensors .* no block-wise FP8 quantization_config"):
        HFCheckpointReader(broken)


@pytest.mark.timeout(600)
def test_import_at_tp2_and_export_equal_the_dequantised_reference(fp8_and_reference, tmp_path):
    from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir

    fp8_dir, ref_dir, _ = fp8_and_reference
    ckpt = hf_to_megatron(fp8_dir, tmp_path / "ckpt", tensor_model_parallel_size=2, timeout_s=300)
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=300)
    got, want = load_safetensors_dir(exported), load_safetensors_dir(ref_dir)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((exported / "config.json").read_text())
    assert "quantization_config" not in config  # the exported weights are not quantised
    assert config == json.loads((ref_dir / "config.json").read_text())
