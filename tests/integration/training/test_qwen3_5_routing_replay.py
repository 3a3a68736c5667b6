"""Rollout Routing Replay (R3) for Qwen3.5-MoE: SGLang captures its routes, the trainer replays them.

SGLang 0.5.23 builds every Qwen3.5 MoE layer as ``Qwen2MoeSparseMoeBlock`` (``models/qwen3_5.py`` lines
1148 and 1382), whose ``TopK(layer_id=...)`` (``models/qwen2_moe.py`` line 307) reports each layer's
chosen experts to the routed-experts capturer (``layers/moe/topk.py``, ``capture_routed_experts_if_allowed``),
so ``return_routed_experts`` answers for this family as for Qwen3-MoE.

References (tiny Qwen3.5-MoE: three gated-DeltaNet layers and one gated-attention layer, every layer MoE, 8
experts top-2, fp32):

- engine: the real SGLang CPU server (the DeltaNet through ``cpu_shims/sglang_gdn_ops.py``) with
  routed-expert capture; its ``[P + N - 1, L, K]`` routes vs transformers' router on the same tokens
  (``Qwen3_5MoeTopKRouter``: softmax, top-k): the same expert set wherever the k-th and (k+1)-th router
  probabilities are not a near-tie (as ``test_engine_generate.py`` for Qwen3-MoE);
- trainer: Megatron-Core (EP2, 2 ranks, alltoall) records its routers' choices (= transformers'),
  replaying them reproduces the logits bit for bit, and replaying other routes (every choice shifted
  by one expert) gives transformers' output for those routes (HF's router weight formula written in
  the test: softmax over all experts, gathered at the forced ones, renormalised) within 1e-4.
"""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch
import torch.nn.functional as F

BATCH, SEQ = 2, 16


def _replay_worker(rank, world_size, hf_dir, tokens, forced_routes):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel
    from megarl.training.routing_replay import RoutingReplay

    parallel = ParallelConfig(expert_model_parallel_size=world_size)
    state = initialize_parallel(parallel, backend="gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    model = chunks[0].eval()
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    replay = RoutingReplay(chunks)
    with torch.no_grad():
        free = model(tokens, position_ids, None)
        replay.record()
        model(tokens, position_ids, None)
        recorded = replay.take_recorded()  # {layer: [S*B, K]} in Megatron's token order (s, b)
        routes = torch.stack([recorded[layer] for layer in range(len(model.decoder.layers))], dim=1)
        replay.replay(routes)
        replayed = model(tokens, position_ids, None)
        replay.replay(forced_routes)
        forced = model(tokens, position_ids, None)
    return dict(free=free, replayed=replayed, forced=forced, recorded=recorded)


def _forced_gate(gate, indices, hidden_states):
    """``Qwen3_5MoeTopKRouter`` with the experts given: softmax over all experts, the weights of the
    given ones renormalised."""
    logits = F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, indices)
    return logits, (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype), indices


def _hf_forward(hf_dir, tokens, forced=None):
    """transformers logits ``[B, S, V]`` and each layer's chosen experts ``{layer: [B*S, K]}``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routes = {}
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if forced is not None:
            gate.forward = functools.partial(_forced_gate, gate, forced[i])
        gate.register_forward_hook(lambda module, args, out, i=i: routes.__setitem__(i, out[2]))
    with torch.no_grad():
        return model(tokens).logits, routes


def _megatron_order(ids):
    """``[B*S, K]`` (HF, b-major) -> ``[S*B, K]`` (Megatron, s-major)."""
    return ids.view(BATCH, SEQ, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)


@pytest.mark.timeout(400)
def test_trainer_records_and_replays_qwen3_5_routes(tiny_qwen3_5_moe_dir):
    import json

    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_routes = _hf_forward(tiny_qwen3_5_moe_dir, tokens)
    assert sorted(ref_routes) == list(range(layers))  # every layer MoE, DeltaNet and attention alike
    shifted = {i: (ids + 1) % experts for i, ids in ref_routes.items()}
    forced = torch.stack([_megatron_order(shifted[i]) for i in range(layers)], dim=1)  # [S*B, L, K]
    ranks = run_ranks(_replay_worker, 2, args=(str(tiny_qwen3_5_moe_dir), tokens, forced), timeout_s=360)
    out, vocab = ranks[0], config["vocab_size"]
    assert torch.equal(ranks[1]["free"], out["free"]) and torch.equal(ranks[1]["forced"], out["forced"])
    assert (out["free"][..., :vocab] - ref_logits).abs().max().item() <= 1e-4
    for i in range(layers):  # Megatron's routers chose transformers' experts
        got = out["recorded"][i].view(SEQ, BATCH, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)
        assert torch.equal(got.sort(dim=-1).values, ref_routes[i].sort(dim=-1).values), i
    assert torch.equal(out["replayed"], out["free"])
    forced_ref, _ = _hf_forward(tiny_qwen3_5_moe_dir, tokens, forced=shifted)
    diff = (out["forced"][..., :vocab] - forced_ref).abs().max().item()
    assert diff <= 1e-4, f"forced-route logit diff {diff:.3g}"
    assert (out["forced"] - out["free"]).abs().max().item() > 1e-3  # the replayed routes mattered


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sglang_captures_qwen3_5_routes_as_transformers_routes(tiny_qwen3_5_moe_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from megarl.rollout.client import SGLangClient
    from megarl.rollout.engine_process import EngineProcess

    async def generate(url: str):
        async with SGLangClient(url) as client:
            return await client.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                                         return_routed_experts=True)

    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    prompt = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = EngineProcess(tiny_qwen3_5_moe_dir, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=2048, grammar_backend="none", enable_return_routed_experts=True,
                           log_path=tmp_path / "engine.log", env={"OMP_NUM_THREADS": "1"})
    with engine.start():
        engine.wait_healthy(timeout_s=600)
        out = asyncio.run(generate(engine.url))
    output, routes = list(out.output_ids), out.routed_experts
    assert routes.shape == (len(prompt) + len(output) - 1, layers, k)

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32).eval()
    logits = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda module, args, out, i=i: logits.__setitem__(i, out[0]))
    with torch.no_grad():
        model(torch.tensor([prompt + output]))
    probs = torch.stack([torch.softmax(logits[i].float(), dim=-1)[:routes.shape[0]] for i in range(layers)], dim=1)
    top = probs.topk(k + 1, dim=-1)
    mismatched = (top.indices[..., :k].sort(-1).values != routes.long().sort(-1).values).any(-1)
    margin = top.values[..., k - 1] - top.values[..., k]  # only near-ties may differ
    print(f"\nQwen3.5 routes: {int(mismatched.sum())} of {mismatched.numel()} decisions differ from transformers")
    assert not (mismatched & (margin > 1e-3)).any(), "engine routing differs from transformers'"
    assert mismatched.float().mean() < 0.05

