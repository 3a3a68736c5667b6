"""Routing replay (R3) for gpt-oss: the SGLang CPU server's captured routes are the routers' choices.

SGLang 0.5.23 captures gpt-oss's routes: ``GptOssSparseMoeBlock`` builds ``TopK(layer_id=...)``
(``models/gpt_oss.py:221-225``) and ``select_experts`` records every call's top-k ids
(``layers/moe/topk.py:3185``). Reference: transformers' ``GptOssTopKRouter`` (``torch.topk`` of the
router logits, bias included) on the same ids and weights (float32, eager). Top-k sets are compared;
a difference counts as a failure only where the k-th and (k+1)-th logits are more than 1e-4 apart
(a near-tie may fall either way between two implementations: two topk kernels order equal logits differently).
"""
from __future__ import annotations

import asyncio

import pytest

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42, 8, 1200, 33, 14]
NEW_TOKENS = 6
TIE = 1e-4


async def _generate(url: str):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(url) as client:
        return await client.generate(PROMPT, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0},
                                     return_routed_experts=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_captured_routes_are_the_transformers_routers_choices(tiny_gpt_oss_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.rollout.engine_process import EngineProcess

    engine = EngineProcess(tiny_gpt_oss_dir, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=2048, grammar_backend="none", enable_return_routed_experts=True,
                           log_path=tmp_path / "engine.log", env={"OMP_NUM_THREADS": "1"})
    with engine.start():
        engine.wait_healthy(timeout_s=600)
        out = asyncio.run(_generate(engine.url))
    ids = PROMPT + list(out.output_ids)
    routes = out.routed_experts  # [P + N - 1, L, K]: every position but the last sampled token
    assert routes is not None and tuple(routes.shape[:1]) == (len(ids) - 1,), None if routes is None else routes.shape
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        router_logits = model(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    assert routes.shape[1:] == (len(router_logits), k)
    same = clear_misses = 0
    for layer, logits in enumerate(router_logits):
        values, order = logits.reshape(len(ids) - 1, -1).sort(dim=-1, descending=True)
        for t in range(len(ids) - 1):
            want, got = set(order[t, :k].tolist()), set(routes[t, layer].tolist())
            same += want == got
            clear_misses += want != got and float(values[t, k - 1] - values[t, k]) > TIE
    total = (len(ids) - 1) * len(router_logits)
    print(f"\ngpt-oss routes: {same} of {total} top-{k} sets equal to transformers' router, "
          f"{clear_misses} differ with a clear margin")
    assert clear_misses == 0 and same >= 0.95 * total
