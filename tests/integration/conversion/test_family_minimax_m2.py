"""MiniMax-M2 on Megatron-Core (CPU, gloo) against transformers: conversion, forward and the q/k norm's gradients.

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical at TP1 and at TP2 x EP2 (expert TP 1):
TP2 splits ``linear_qkv`` by query group and keeps the whole ``[heads * head_dim]`` q/k norm weights
on both ranks, EP2 places experts 0-3 and 4-7 on different ranks, and the norms and router bias are
random, so a swapped norm, a lost bias or a wrong expert order cannot come back bit-identical.
Reference: the original safetensors files and config.json.

Forward: Megatron's logits (local spec, ``FullHeadRMSNorm`` as q/k norms, partial RoPE, the
bias-corrected sigmoid router) equal transformers' within 1e-5, fp32, at TP1 and TP2 x EP2 with
sequence parallelism, one sequence per row and both packed in one row. At TP2 each rank holds half
the heads, so a norm without the all-reduce (each rank's RMS over its own heads) changes the logits.

Gradients: at TP2 the gradients of layer 0's ``linear_qkv`` and q/k norm weights (a fixed random
linear functional of the logits) equal transformers' gradients of ``q_proj`` / ``k_proj`` /
``v_proj`` / ``q_norm`` / ``k_norm``, the norms' after the TP sum Megatron's ``finalize_model_grads``
applies to q/k norm gradients (``distributed/finalize_model_grads.py`` line 355): this checks the
all-reduce's backward (an all-reduce) and the replicated weight's slice gradients.
"""
import json

import pytest
import torch

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

BATCH, SEQ = 2, 24
TP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
LAYOUTS = {"tp1": {}, "tp2_ep2_etp1": TP2}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_bit_identical(tiny_minimax_m2_dir, layout, tmp_path):
    ckpt = hf_to_megatron(tiny_minimax_m2_dir, tmp_path / "ckpt", timeout_s=280, **LAYOUTS[layout])
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=280)
    ref, out = _load_all(tiny_minimax_m2_dir), _load_all(exported)
    assert ref["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 16,)  # all heads, not one
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in ref
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    config = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == config


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_transformers(tiny_minimax_m2_dir, layout):
    from transformers import AutoModelForCausalLM

    from megarl.testing.family_forward import megatron_logits
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    ranks = run_ranks(megatron_logits, 1 if layout == "tp1" else 2,
                      args=(str(tiny_minimax_m2_dir), tokens, LAYOUTS[layout], True), timeout_s=500)
    for rank in ranks:
        for logits, what in zip(rank, ("batched", "packed")):
            diff = (logits[..., :config["vocab_size"]] - ref).abs().max().item()
            assert diff <= 1e-5, f"{layout}, {what}: max |Megatron - transformers| logit diff {diff:.3g}"


GRAD_NAMES = ("linear_qkv.weight", "q_layernorm.weight", "k_layernorm.weight")


def _grad_worker(rank, world_size, hf_dir, tokens, probe):
    """Layer 0's attention gradients of ``sum(logits * probe)`` on this TP rank (``probe [B, S, V_padded]``)."""
    from megatron.core import parallel_state as mps

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    parallel = ParallelConfig(**TP2, sequence_parallel=True)
    state = initialize_parallel(parallel, backend="gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    chunks[0].eval()
    logits = chunks[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)  # [B, S, V_padded / tp]
    width, tp_rank = logits.shape[-1], mps.get_tensor_model_parallel_rank()
    (logits * probe[..., tp_rank * width:(tp_rank + 1) * width]).sum().backward()
    return {n: p.grad.clone() for n, p in chunks[0].decoder.layers[0].self_attention.named_parameters()
            if n in GRAD_NAMES}


@pytest.mark.timeout(300)
def test_qk_norm_gradients_match_transformers_at_tp2(tiny_minimax_m2_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.models.families import get_family
    from megarl.models.mapping import gather_tp, lookup, to_hf
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=gen)
    family = get_family("minimax_m2")
    layout = family.layout(AutoConfig.from_pretrained(tiny_minimax_m2_dir), tp_size=2)
    probe = torch.zeros(BATCH, SEQ, layout.padded_vocab_size)
    probe[..., :config["vocab_size"]] = torch.randn(BATCH, SEQ, config["vocab_size"], generator=gen)
    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    (model(tokens).logits * probe[..., :config["vocab_size"]]).sum().backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    ranks = run_ranks(_grad_worker, 2, args=(str(tiny_minimax_m2_dir), tokens, probe), timeout_s=240)
    for name in GRAD_NAMES:
        entry, values = lookup(family.table, f"decoder.layers.0.self_attention.{name}")
        shards = [grads[name] for grads in ranks]
        # q/k norms: replicated, each rank's gradient on its heads' slice; finalize_model_grads sums them
        full = sum(shards) if name != "linear_qkv.weight" else gather_tp(shards, entry.tp_split, layout)
        for hf_name, ours in zip([t.format(**values) for t in entry.hf], to_hf(entry, full, layout)):
            ref = hf_grads[hf_name]
            assert ref.abs().max() > 0, hf_name
            diff = (ours - ref).abs().max().item()
            assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"{hf_name}: max |grad diff| {diff:.3g}"


def _replay_worker(rank, world_size, hf_dir, tokens, forced_routes):
    """Free logits, and the logits with ``forced_routes [S*B, L, K]`` replayed (R3), on one CPU rank."""
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel
    from megarl.training.routing_replay import RoutingReplay

    state = initialize_parallel(ParallelConfig(), backend="gloo")
    chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    replay = RoutingReplay(chunks)
    with torch.no_grad():
        free = chunks[0](tokens, position_ids, None)
        replay.replay(forced_routes)
        forced = chunks[0](tokens, position_ids, None)
    return {"free": free, "forced": forced}


def _forced_gate(gate, indices, hidden_states, e_score_correction_bias):
    """transformers' ``MiniMaxM2TopKRouter`` with the experts given: weights ``sigmoid(h W^T)`` at them,
    renormalised (no scaling)."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim).float(), gate.weight.float())
    weights = logits.sigmoid().gather(1, indices)
    return logits, weights / weights.sum(dim=-1, keepdim=True), indices


@pytest.mark.timeout(300)
def test_replayed_routes_give_transformers_output_for_those_routes(tiny_minimax_m2_dir):
    """R3 on MiniMax-M2's bias-corrected sigmoid router: replaying other routes (each token's
    transformers choice shifted by one expert, every layer) gives transformers' output with its gates
    forced to them, and differs from the free forward."""
    import functools

    from transformers import AutoModelForCausalLM

    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    routes = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: routes.__setitem__(i, out[2]))
    with torch.no_grad():
        model(tokens)
    shifted = {i: (ids + 1) % config["num_local_experts"] for i, ids in routes.items()}  # [B*S, K], b-major
    forced = torch.stack([ids.view(BATCH, SEQ, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)  # Megatron: s-major
                          for _, ids in sorted(shifted.items())], dim=1)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.forward = functools.partial(_forced_gate, layer.mlp.gate, shifted[i])
    with torch.no_grad():
        forced_ref = model(tokens).logits
    (out,) = run_ranks(_replay_worker, 1, args=(str(tiny_minimax_m2_dir), tokens, forced), timeout_s=240)
    vocab = config["vocab_size"]
    diff = (out["forced"][..., :vocab] - forced_ref).abs().max().item()
    assert diff <= 1e-5, f"replayed routes vs transformers with the same routes: max |logit diff| {diff:.3g}"
    assert (out["forced"] - out["free"]).abs().max().item() > 1e-3  # the replayed routes mattered
