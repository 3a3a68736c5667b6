"""SGLang's MLA model (DeepSeek-V3 family) on the CPU server: prefill and decode equal transformers.

Without ``megarl/rollout/cpu_shims/sglang_mla_dispatch.py`` SGLang 0.5.23 sends an MLA prefill on the
``torch_native`` backend down its MHA path, which attends over the compressed latent cache and
stops the server at its first request ("Expected size for first two dimensions of batch2 tensor").
Reference: a Hugging Face forward pass of the same weights over the same tokens (float32).
"""
from __future__ import annotations

import json
import urllib.request

import pytest

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42]
NEW_TOKENS = 8
TOL = 2e-3
"""float32 on both sides; SGLang attends with the absorbed (latent) weights, transformers with the
decompressed heads: the same algebra, another summation order."""


def _generate(url: str, ids: list[int], new_tokens: int, logprob_start_len: int) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": logprob_start_len,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as resp:
        return json.load(resp)["meta_info"]


def _hf_logprobs(model_dir, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_deepseek_v3_engine_prefill_and_decode_match_transformers(tiny_deepseek_v3_dir, tmp_path):
    from megarl.rollout.engine_process import EngineProcess

    engine = EngineProcess(tiny_deepseek_v3_dir, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=2048, grammar_backend="none", log_path=tmp_path / "engine.log")
    with engine.start():
        engine.wait_healthy(timeout_s=600)
        first = _generate(engine.url, PROMPT, NEW_TOKENS, 0)
        out_ids = [t for _, t, _ in first["output_token_logprobs"]]
        # A second turn on the cached prefix: prefill over a radix-cache hit (no prompt logprobs, which
        # would recompute the prefix), then decode.
        turn2 = PROMPT + out_ids + [11, 12, 13]
        second = _generate(engine.url, turn2, 4, -1)
    assert len(out_ids) == NEW_TOKENS
    assert second["cached_tokens"] > 0, "the second turn did not reuse the cached prefix"

    ref = _hf_logprobs(tiny_deepseek_v3_dir, turn2 + [t for _, t, _ in second["output_token_logprobs"]])
    got_first = [lp for lp, _, _ in first["input_token_logprobs"][1:]] + \
        [lp for lp, _, _ in first["output_token_logprobs"]]
    got_second = [lp for lp, _, _ in second["output_token_logprobs"]]
    assert len(got_first) == len(PROMPT) - 1 + NEW_TOKENS and len(got_second) == 4
    gap_first = max(abs(a - b) for a, b in zip(got_first, ref[:len(got_first)]))
    gap_second = max(abs(a - b) for a, b in zip(got_second, ref[-4:]))
    assert gap_first < TOL, f"first turn (prefill + decode) vs transformers: {gap_first}"
    assert gap_second < TOL, f"second turn (cached prefix + decode) vs transformers: {gap_second}"
