"""Qwen3.5-MoE on Megatron-Core (CPU, gloo) against transformers: the forward pass and conversion.

Forward: Megatron's logits (the local spec: megarl's ``LocalGatedDeltaNet`` for the three DeltaNet
layers, Megatron's gated ``SelfAttention`` for the full-attention layer, zero-centred norms) equal
transformers' logits of the same HF directory (its torch fallbacks of the causal conv and the
chunked gated delta rule) within 1e-5, fp32, at TP1 and at TP2 x EP2 with sequence parallelism
(expert TP 1), both with one sequence per row and with the two sequences packed in one row: the
DeltaNet recurrence must restart at the second sequence, so a leak across packed sequences changes
the second one's logits.

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical at TP1 and at TP2 x EP2 (expert
TP 1). TP2 splits the DeltaNet's ``in_proj`` rows per section ``[q; k; v; z; beta; alpha]``, its
conv channels per section ``[q; k; v]``, ``A_log`` / ``dt_bias`` by head, and the gated attention's
``[q; gate; k; v]`` rows by query group, and EP2 places experts 0-3 and 4-7 on different ranks, so
a wrong section order, gate interleave or expert order cannot come back bit-identical (``A_log`` is
random per head). Reference: the original safetensors files and config.json.
"""
import json

import pytest
import torch

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

BATCH, SEQ = 2, 24
LAYOUTS = {"tp1": {},
           "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_bit_identical(tiny_qwen3_5_moe_dir, layout, tmp_path):
    ckpt = hf_to_megatron(tiny_qwen3_5_moe_dir, tmp_path / "ckpt", timeout_s=280, **LAYOUTS[layout])
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=280)
    ref, out = _load_all(tiny_qwen3_5_moe_dir), _load_all(exported)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in ref and "model.layers.3.self_attn.q_proj.weight" in ref
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == config


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_transformers(tiny_qwen3_5_moe_dir, layout):
    from transformers import AutoModelForCausalLM

    from megarl.testing.family_forward import megatron_logits
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    assert {"linear_attention", "full_attention"} <= set(config["layer_types"])
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    ranks = run_ranks(megatron_logits, 1 if layout == "tp1" else 2,
                      args=(str(tiny_qwen3_5_moe_dir), tokens, LAYOUTS[layout], True), timeout_s=500)
    for rank in ranks:
        for logits, what in zip(rank, ("batched", "packed")):
            diff = (logits[..., :config["vocab_size"]] - ref).abs().max().item()
            assert diff <= 1e-5, f"{layout}, {what}: max |Megatron - transformers| logit diff {diff:.3g}"


GRAD_SEQ = 80  # past the gated delta rule's 64-token chunk


def _grad_worker(rank, world_size, hf_dir, tokens, vocab):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    state = initialize_parallel(ParallelConfig(), backend="gloo")
    chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    logits = chunks[0](tokens, torch.arange(GRAD_SEQ).expand_as(tokens), None)
    logits[..., :vocab].logsumexp(-1).mean().backward()
    names = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight")
    return {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
            for n, p in chunks[0].decoder.layers[0].self_attention.named_parameters() if n in names}


@pytest.mark.timeout(300)
def test_deltanet_gradients_match_transformers(tiny_qwen3_5_moe_dir):
    """The first DeltaNet layer's gradients (a logsumexp loss over 80 tokens: two chunks of the delta
    rule) equal transformers' gradients of the same HF tensors within 1e-5 of their scale, at TP1."""
    from transformers import AutoModelForCausalLM

    from megarl.models.families import get_family
    from megarl.models.mapping import lookup, to_hf
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, GRAD_SEQ), generator=torch.Generator().manual_seed(5))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32)
    model(tokens).logits.logsumexp(-1).mean().backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    grads = run_ranks(_grad_worker, 1, args=(str(tiny_qwen3_5_moe_dir), tokens, config["vocab_size"]),
                      timeout_s=240)[0]
    family = get_family("qwen3_5_moe")
    layout = family.layout(model.config)
    for name, grad in grads.items():
        entry, values = lookup(family.table, f"decoder.layers.0.self_attention.{name}")
        for hf_name, ours in zip([t.format(**values) for t in entry.hf], to_hf(entry, grad, layout)):
            ref = hf_grads[hf_name]
            assert ref.abs().max() > 0, hf_name
            assert (ours - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), hf_name
