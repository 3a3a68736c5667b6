"""gpt-oss conversion: HF -> Megatron dist checkpoint -> HF is bit-identical at TP2 (expert TP 1)
and at TP2 x EP2 (expert TP 1) on the tiny model (2 gloo ranks each). Expert TP is 1 because
Megatron-Core 0.16.1 refuses MoE biases otherwise (``transformer_config.py`` line 1588: "Bias in
Moe is only supported when ETP==1").

References: the original safetensors files (read with the safetensors library: HF's stacked expert
tensors ``mlp.experts.gate_up_proj [E, H, 2F]`` with gate / up columns interleaved, biases, sinks)
and the original config.json. TP2 splits the sinks and q/k/v rows by head and each expert's
de-interleaved ``[gate; up]`` rows by half; EP2 places experts 0-3 and 4-7 on different ranks, so a
wrong interleave, transpose or expert order cannot come back bit-identical.
"""
import json

import pytest
import torch

from megarl.checkpoint.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

LAYOUTS = {"tp2_etp1": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
           "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1)}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_bit_identical(tiny_gpt_oss_dir, layout, tmp_path):
    ckpt = hf_to_megatron(tiny_gpt_oss_dir, tmp_path / "ckpt", timeout_s=240, **LAYOUTS[layout])
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=240)
    ref, out = _load_all(tiny_gpt_oss_dir), _load_all(exported)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref and "model.layers.1.self_attn.sinks" in ref
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    assert json.loads((exported / "config.json").read_text()) == json.loads((tiny_gpt_oss_dir / "config.json").read_text())
