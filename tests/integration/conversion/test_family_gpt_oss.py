"""gpt-oss on Megatron-Core (CPU, gloo) against transformers: the forward pass and conversion.

Forward: Megatron's logits (the local spec: sinks and the sliding window through
``LocalSDPAttention._sink_window_attention``) equal transformers' logits of the same HF directory
(eager attention with sinks) within 1e-5, fp32, at TP1 and at TP2 x EP2 (expert TP 1), both with
one sequence per row and with the two sequences packed in one row (block-diagonal causal mask, as
training packs them); the sequences (24 tokens) are longer than the tiny model's window (4), so the
window matters (the tiny model's logits move by 0.41 with every layer full attention).

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical at TP2 (expert TP 1) and at
TP2 x EP2 (expert TP 1) on the tiny model (2 gloo ranks each). Expert TP is 1 because
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

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

BATCH, SEQ = 2, 24
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


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp1", "tp2_ep2_etp1"])
def test_forward_matches_transformers(tiny_gpt_oss_dir, layout):
    from transformers import AutoModelForCausalLM

    from megarl.testing.family_forward import megatron_logits
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_gpt_oss_dir / "config.json").read_text())
    assert SEQ > config["sliding_window"] and "sliding_attention" in config["layer_types"]
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    ranks = run_ranks(megatron_logits, 1 if layout == "tp1" else 2,
                      args=(str(tiny_gpt_oss_dir), tokens, LAYOUTS.get(layout, {}), True), timeout_s=360)
    for rank in ranks:
        for logits, what in zip(rank, ("batched", "packed")):
            diff = (logits[..., :config["vocab_size"]] - ref).abs().max().item()
            assert diff <= 1e-5, f"{layout}, {what}: max |Megatron - transformers| logit diff {diff:.3g}"
