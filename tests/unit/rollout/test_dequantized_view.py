"""A block-FP8 checkpoint on a CPU engine (the DeepSeek-V3 / Kimi-K2 recipes' twins): the tiny block-FP8
checkpoint is laid out as DeepSeek-V3's release, its dequantised view holds ``q * scale_inv`` of every
weight, and an engine rank's received FP8 slice with its scale blocks becomes, before loading, a weight
within the e4m3 block bound of the trainer's.

References: the per-block loop below (not ``dequantize_blockwise``), safetensors' own reading, and the
unquantised tiny model of the same seed (the trainer's weights)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megarl.models.tiny import TinyModelSpec, make_tiny_model
from megarl.rollout.dequantized_view import VIEW_KEY, dequantized_model_dir, served_tensors, wire_manifest_dir

BLOCK = 16
Q_B = "model.layers.1.self_attn.q_b_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _read(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})
    return out


def _per_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    plain = make_tiny_model(root / "plain", TinyModelSpec(family="deepseek_v3", mtp_layers=1))
    fp8 = make_tiny_model(root / "fp8", TinyModelSpec(family="deepseek_v3", mtp_layers=1, fp8_block=BLOCK))
    return plain, fp8, root


@pytest.mark.timeout(120)
def test_tiny_block_fp8_checkpoint_and_its_dequantised_view(checkpoints):
    plain, fp8, root = checkpoints
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [BLOCK, BLOCK]}
    stored, reference = _read(fp8), _read(plain)
    assert stored[Q_B].dtype == torch.float8_e4m3fn and stored[Q_B + "_scale_inv"].shape == (96 // BLOCK, 32 // BLOCK)
    assert stored["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn  # the MTP layer too, as released
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert stored[name].dtype == torch.float32 and torch.equal(stored[name], reference[name]), name
    view = dequantized_model_dir(fp8, root=root / "views")
    assert dequantized_model_dir(fp8, root=root / "views") == view  # cached
    assert dequantized_model_dir(plain, root=root / "views") == str(plain)  # unquantised: served as it is
    view_config = json.loads(Path(view, "config.json").read_text())
    assert "quantization_config" not in view_config
    assert view_config[VIEW_KEY]["quantization_config"] == config["quantization_config"]
    assert wire_manifest_dir(view) == str(fp8.resolve()) and wire_manifest_dir(str(plain)) == str(plain)
    held = _read(Path(view))
    assert sorted(held) == sorted(n for n in stored if not n.endswith("_scale_inv"))
    for name, tensor in stored.items():
        if tensor.dtype == torch.float8_e4m3fn:
            assert torch.equal(held[name], _per_block(tensor, stored[name + "_scale_inv"])), name
        elif not name.endswith("_scale_inv"):
            assert torch.equal(held[name], tensor), name


def _within_block_bound(weight: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: an element is within half a step of the top binade (16 in units of
    its block's scale) of the weight, plus fp32 rounding (relative 1e-3)."""
    per = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:weight.shape[0], :weight.shape[1]]
    return bool(((weight - reference.float()).abs() <= 16 * per * (1 + 1e-3)).all())


@pytest.mark.timeout(120)
def test_an_engine_ranks_fp8_slices_are_dequantised_before_loading(checkpoints):
    from megarl.models.fp8_blocks import quantize_blockwise

    plain, fp8, root = checkpoints
    view = dequantized_model_dir(fp8, root=root / "views")
    trainer = _read(plain)
    # engine rank 1 of TP 2: q_b_proj's rows of heads 2-3 (48 of 96, blocks 3-5), an expert's down_proj
    # columns 16-31 (block 1): the sender quantises the whole tensor and sends the rank its slice
    named, expected = [], {}
    for name, axis in ((Q_B, 0), (EXPERT, 1)):
        q, scale = quantize_blockwise(trainer[name], (BLOCK, BLOCK))
        half, blocks = q.shape[axis] // 2, scale.shape[axis] // 2
        named += [(name, q.narrow(axis, half, half)), (name + "_scale_inv", scale.narrow(axis, blocks, blocks))]
        expected[name] = (trainer[name].narrow(axis, half, half), scale.narrow(axis, blocks, blocks))
    norm = "model.layers.1.input_layernorm.weight"
    named.append((norm, trainer[norm]))
    loaded = dict(served_tensors(view, named))
    assert sorted(loaded) == sorted([Q_B, EXPERT, norm])
    for name, (reference, scale) in expected.items():
        assert loaded[name].dtype == torch.float32 and loaded[name].shape == reference.shape
        assert _within_block_bound(loaded[name], reference, scale), name
        assert not torch.equal(loaded[name], reference)  # FP8 really crossed: the weight moved within its bound
    assert loaded[norm] is trainer[norm]
    as_sent = served_tensors(str(plain), named)  # an engine serving an unquantised checkpoint
    assert [n for n, _ in as_sent] == [n for n, _ in named] and all(a is b for (_, a), (_, b) in zip(as_sent, named))
    with pytest.raises(ValueError, match="q_b_proj.weight_scale_inv"):
        served_tensors(view, [named[0]])
