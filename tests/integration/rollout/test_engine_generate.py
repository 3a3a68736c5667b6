"""SGLangClient.generate against the real SGLang CPU server, checked against transformers."""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.client import SGLangClient
from megarl.rollout.engine_process import EngineProcess, EngineStartupError

pytestmark = pytest.mark.timeout(300)


def _prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _teacher_forced(model, prompt_ids, output_ids, *, router_logits: bool = False):
    """log p(output_t | prefix) from one transformers forward over prompt + output."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        out = model(ids, output_router_logits=router_logits)
    logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output_ids) - 1)
    token_logprobs = logprobs[positions, torch.tensor(output_ids)]
    return token_logprobs, (out.router_logits if router_logits else None)


async def test_generate_matches_transformers_teacher_forcing(sglang_url, tiny_moe_hf):
    model, tokenizer = tiny_moe_hf
    prompt = _prompt(tokenizer, "Natalia sold clips to 48 of her friends. How many clips?")
    async with SGLangClient(sglang_url) as client:
        sampled = await client.generate(prompt, {"max_new_tokens": 24, "temperature": 1.0,
                                                 "ignore_eos": True})
        greedy = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})

    assert sampled.finish_reason == "length"
    assert len(sampled.output_ids) == len(sampled.output_logprobs) == 24
    ref, _ = _teacher_forced(model, prompt, sampled.output_ids)
    diff = (ref - torch.tensor(sampled.output_logprobs)).abs().max().item()
    assert diff < 5e-3, f"engine vs transformers logprob gap {diff}"

    with torch.no_grad():
        hf_greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert greedy.output_ids == hf_greedy[0, len(prompt):len(prompt) + len(greedy.output_ids)].tolist()
    assert greedy.engine_id == sglang_url
    assert greedy.weight_version is not None


async def test_stop_on_eos_reports_stop(sglang_url, tiny_moe_hf):
    _, tokenizer = tiny_moe_hf
    prompt = _prompt(tokenizer, "Say hi.")
    async with SGLangClient(sglang_url) as client:
        # Once the regex is complete the grammar allows only EOS (<|im_end|>): the engine must stop.
        out = await client.generate(prompt, {"max_new_tokens": 16, "temperature": 1.0,
                                             "regex": "ok",
                                             "skip_special_tokens": False})
    assert out.finish_reason == "stop"
    assert tokenizer.decode(out.output_ids) == "ok<|im_end|>"


async def test_routed_experts_match_transformers_router(sglang_url, tiny_moe_hf):
    model, tokenizer = tiny_moe_hf
    prompt = _prompt(tokenizer, "Weng earns $12 an hour for babysitting.")
    async with SGLangClient(sglang_url) as client:
        out = await client.generate(prompt, {"max_new_tokens": 10, "temperature": 1.0,
                                             "ignore_eos": True}, return_routed_experts=True)
        tail = await client.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0},
                                     return_routed_experts=True, routed_experts_start_len=len(prompt))
    cfg = model.config
    num_rows = len(prompt) + len(out.output_ids) - 1
    assert out.routed_experts.shape == (num_rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert out.routed_experts.dtype == torch.int32
    assert tail.routed_experts.shape[0] == len(tail.output_ids) - 1

    _, router_logits = _teacher_forced(model, prompt, out.output_ids, router_logits=True)
    probs = torch.stack([torch.softmax(r.float(), dim=-1)[:num_rows] for r in router_logits], dim=1)
    k = cfg.num_experts_per_tok
    top = probs.topk(k + 1, dim=-1)
    hf_sets = top.indices[..., :k].sort(-1).values
    engine_sets = out.routed_experts.long().sort(-1).values
    # Only near-ties (k-th vs (k+1)-th router probability within 1e-3) may differ.
    margin = top.values[..., k - 1] - top.values[..., k]
    mismatched = (hf_sets != engine_sets).any(-1)
    assert not (mismatched & (margin > 1e-3)).any(), "engine routing differs from transformers"
    assert mismatched.float().mean() < 0.05


@pytest.mark.timeout(120)
def test_failed_startup_raises_with_server_log(tiny_moe_dir, tmp_path):
    engine = EngineProcess(tiny_moe_dir, device="cpu", extra_args=["--no-such-sglang-flag"],
                           log_path=tmp_path / "bad.log", env={"OMP_NUM_THREADS": "1"})
    engine.start()
    with pytest.raises(EngineStartupError) as info:
        engine.wait_healthy(timeout_s=100)
    assert "--no-such-sglang-flag" in str(info.value)  # the server's own error, from its log
    assert not engine.is_alive()
