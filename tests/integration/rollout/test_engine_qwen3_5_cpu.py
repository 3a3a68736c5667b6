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

import json
import urllib.request

import pytest

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42]
OTHER = [8, 1200, 33, 14, 600, 2, 77, 5, 19]
NEW_TOKENS = 8
TOL = 2e-3
"""float32 on both sides, as the other families' serving tests (``test_engine_gpt_oss_cpu.py``)."""


def _generate(url: str, ids, new_tokens: int, logprob_start_len: int):
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": logprob_start_len,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as resp:
        out = json.load(resp)
    return [o["meta_info"] for o in out] if isinstance(out, list) else out["meta_info"]


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _all_logprobs(meta) -> tuple[list[int], list[float]]:
    """Output ids, and the logprobs of every prompt token after the first then every output token."""
    out_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:]] + [lp for lp, _, _ in meta["output_token_logprobs"]]
    return out_ids, got


def _gap(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref)
    return max(abs(a - b) for a, b in zip(got, ref))


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
        first = _generate(engine.url, PROMPT, NEW_TOKENS, 0)
        out_ids, got_first = _all_logprobs(first)
        # A second turn on the first one's tokens (SGLang may serve its prefix from the cache).
        turn2 = PROMPT + out_ids + [11, 12, 13]
        second = _generate(engine.url, turn2, 4, -1)
        # Two requests of different lengths in one batch (one prefill over both, then batched decode).
        batch = _generate(engine.url, [OTHER, PROMPT[:11]], NEW_TOKENS, 0)
    assert len(out_ids) == NEW_TOKENS

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32).eval()
    second_out = [t for _, t, _ in second["output_token_logprobs"]]
    ref_second = _hf_logprobs(model, turn2 + second_out)
    gaps = {"first turn (prefill + decode)": _gap(got_first, ref_second[:len(got_first)]),
            f"second turn ({second['cached_tokens']} cached tokens + decode)": _gap(
                [lp for lp, _, _ in second["output_token_logprobs"]], ref_second[-4:])}
    for prompt, meta in zip([OTHER, PROMPT[:11]], batch):
        ids, got = _all_logprobs(meta)
        gaps[f"batched request of {len(prompt)} tokens"] = _gap(got, _hf_logprobs(model, prompt + ids))
    print("engine vs transformers, max |logprob gap|:", gaps)
    assert max(gaps.values()) < TOL, f"engine vs transformers logprob gaps: {gaps}"
