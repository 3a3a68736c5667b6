"""MiniMax-M2 on the real SGLang CPU server: served as transformers computes it, its routes captured for
R3, and synced by every transport (issue 37 part 2; the ``p2p`` sync with the load proof is
``test_load_proof.py``'s ``minimax_m2`` case).

One engine (engine TP 1, megarl's custom loaders, ``--enable-return-routed-experts``) for the module.
References: transformers' forward and router of the tiny model (``MiniMaxM2TopKRouter``: experts by
top-k of ``sigmoid(x W^T) + e_score_correction_bias``); after a sync, the 2-rank trainer's own logprobs
and the ``disk`` transport (``/update_weights_from_disk`` of safetensors).
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from megarl.testing.engine_logprobs import all_logprobs, generate, max_gap, teacher_forced_logprobs
from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import workers
from test_weight_sync_engine import TOLERANCE, gap, probes, train_sequences

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42]
SERVING_TOL = 2e-3
"""float32 on both sides, as the other families' serving tests."""


@pytest.fixture(scope="module")
def minimax_engine(tiny_minimax_m2_dir, tmp_path_factory):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    engine = EngineProcess(tiny_minimax_m2_dir, tp_size=1, device="cpu", dtype="float32", mem_fraction_static=0.15,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           enable_return_routed_experts=True, env={"OMP_NUM_THREADS": "1"},
                           log_path=tmp_path_factory.mktemp("logs") / "minimax_engine.log", engine_id="minimax_engine")
    engine.start()
    try:
        engine.wait_healthy(300)
        yield engine
    finally:
        engine.stop(grace_s=0)


async def _routes(url: str, prompt: list[int]):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(url) as client:
        return await client.generate(prompt, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                                     return_routed_experts=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_served_logprobs_and_routes_equal_transformers(minimax_engine, tiny_minimax_m2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    out_ids, got = all_logprobs(generate(minimax_engine.url, PROMPT, 8, 0))
    logprob_gap = max_gap(got, teacher_forced_logprobs(model, PROMPT + out_ids))
    routed = asyncio.run(_routes(minimax_engine.url, PROMPT))
    cfg = model.config
    rows = len(PROMPT) + len(routed.output_ids) - 1
    assert routed.routed_experts.shape == (rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)

    logits = []  # per layer: transformers' router logits [tokens, E] (MiniMaxM2TopKRouter's first output)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: logits.append(o[0].float()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([PROMPT + routed.output_ids]))
    for h in hooks:
        h.remove()
    bias = [layer.mlp.e_score_correction_bias.float() for layer in model.model.layers]
    select = torch.stack([torch.sigmoid(x[:rows]) + b for x, b in zip(logits, bias)], dim=1)  # [rows, L, E]
    k = cfg.num_experts_per_tok
    top = select.topk(k + 1, dim=-1)
    mismatched = (top.indices[..., :k].sort(-1).values != routed.routed_experts.long().sort(-1).values).any(-1)
    margin = top.values[..., k - 1] - top.values[..., k]
    print(f"\nengine vs transformers: max |logprob gap| {logprob_gap:.2e}; routing sets differ at "
          f"{int(mismatched.sum())} of {mismatched.numel()} (token, layer) pairs")
    assert logprob_gap < SERVING_TOL
    assert not (mismatched & (margin > 1e-3)).any(), "engine routing differs from transformers' beyond near-ties"
    assert mismatched.float().mean() < 0.05


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_transport_after_training_at_trainer_tp2(minimax_engine, tiny_minimax_m2_dir, tmp_path):
    """Two GSPO steps at trainer TP 2 (the q/k norms' sum of squares all-reduced), then ``distributed``,
    ``disk``, ``shard`` and ``tensor``: each leaves the engine answering as the trainer, and identically."""
    out = run_ranks(workers.train_then_sync, 2, timeout_s=840, args=(
        str(tiny_minimax_m2_dir), ["tp2"], ["distributed", "disk", "shard", "tensor"], [minimax_engine.url],
        probes(), 1, str(tmp_path), train_sequences()))[0]["tp2"]
    for transport, after in out["after"].items():
        before, _ = gap(out["before"][transport][0], out["trainer"])
        mean, peak = gap(after[0], out["trainer"])
        print(f"\n{transport}: mean |engine - trainer| {before:.4f} -> {mean:.2e} (max {peak:.2e})")
        assert before > 20 * TOLERANCE and mean <= TOLERANCE, (transport, before, mean, peak)
        assert out["stale_detected"][transport]
        assert after == out["after"]["disk"], transport
