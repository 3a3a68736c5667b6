"""A real SGLang server's logprobs against transformers' forward, for the family serving tests
(``tests/integration/rollout/test_engine_*_cpu.py``)."""
from __future__ import annotations

import json
import urllib.request
from typing import Any


def generate(url: str, ids: list[int] | list[list[int]], new_tokens: int, logprob_start_len: int) -> Any:
    """Greedy ``/generate`` (SGLang's native API) of ``ids`` (one prompt, or a batch of prompts) with
    logprobs from token ``logprob_start_len`` on (-1: output tokens only), ``ignore_eos``.

    Returns:
        The response's ``meta_info`` (a list of them for a batch).

    Raises:
        urllib.error.URLError: the server refused or did not answer within 240 s.
    """
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": logprob_start_len,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as resp:
        out = json.load(resp)
    return [o["meta_info"] for o in out] if isinstance(out, list) else out["meta_info"]


def teacher_forced_logprobs(model, ids: list[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for ``i = 1 .. len(ids) - 1`` from a transformers causal LM (fp32 softmax)."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def all_logprobs(meta: dict) -> tuple[list[int], list[float]]:
    """A response's output ids, and the logprobs of every prompt token after the first then of every
    output token (``logprob_start_len=0``)."""
    out_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:]] + [lp for lp, _, _ in meta["output_token_logprobs"]]
    return out_ids, got


def max_gap(got: list[float], ref: list[float]) -> float:
    """``max |got - ref|``; the two lists must have one entry per token.

    Raises:
        AssertionError: the lengths differ.
    """
    assert len(got) == len(ref), (len(got), len(ref))
    return max(abs(a - b) for a, b in zip(got, ref))
