"""SGLang's Qwen3.5-MoE model on the CPU server: prefill, decode, a second turn and a batch equal transformers.

Without ``megarl/rollout/cpu_shims/sglang_gdn_ops.py`` SGLang 0.5.23 cannot import its Qwen3.5 model on
CPU (its gated-DeltaNet and gated-attention kernels come from the ``sgl_kernel`` CPU build,
``layers/attention/linear/gdn_backend.py`` lines 183-188, ``models/qwen3_5.py`` lines 283-298). The
tiny model has three gated-DeltaNet layers (GQA 2 key / 4 value heads, conv width 4) and one gated
attention layer, every layer MoE with a gated shared expert, random norms; the prompts are longer than
the conv window so conv and recurrent states carry across prefill, decode steps and requests.
Reference: transformers' forward of the same weights (float32).
"""
from __future__ import annotations

import pytest

from megarl.testing.engine_logprobs import all_logprobs, generate, max_gap, teacher_forced_logprobs

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42]
OTHER = [8, 1200, 33, 14, 600, 2, 77, 5, 19]
NEW_TOKENS = 8
TOL = 2e-3
"""float32 on both sides, as the other families' serving tests (``test_engine_gpt_oss_cpu.py``)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_qwen3_5_moe_engine_matches_transformers(tiny_qwen3_5_moe_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.rollout.engine_process import EngineProcess

    engine = EngineProcess(tiny_qwen3_5_moe_dir, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=2048, grammar_backend="none", log_path=tmp_path / "engine.log",
                           env={"OMP_NUM_THREADS": "1"})
    with engine.start():
        engine.wait_healthy(timeout_s=600)
        first = generate(engine.url, PROMPT, NEW_TOKENS, 0)
        out_ids, got_first = all_logprobs(first)
        # A second turn on the first one's tokens (SGLang may serve its prefix from the cache).
        turn2 = PROMPT + out_ids + [11, 12, 13]
        second = generate(engine.url, turn2, 4, -1)
        # Two requests of different lengths in one batch (one prefill over both, then batched decode).
        batch = generate(engine.url, [OTHER, PROMPT[:11]], NEW_TOKENS, 0)
    assert len(out_ids) == NEW_TOKENS

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32).eval()
    second_out = [t for _, t, _ in second["output_token_logprobs"]]
    ref_second = teacher_forced_logprobs(model, turn2 + second_out)
    gaps = {"first turn (prefill + decode)": max_gap(got_first, ref_second[:len(got_first)]),
            f"second turn ({second['cached_tokens']} cached tokens + decode)": max_gap(
                [lp for lp, _, _ in second["output_token_logprobs"]], ref_second[-4:])}
    for prompt, meta in zip([OTHER, PROMPT[:11]], batch):
        ids, got = all_logprobs(meta)
        gaps[f"batched request of {len(prompt)} tokens"] = max_gap(got, teacher_forced_logprobs(model, prompt + ids))
    print("engine vs transformers, max |logprob gap|:", gaps)
    assert max(gaps.values()) < TOL, f"engine vs transformers logprob gaps: {gaps}"
