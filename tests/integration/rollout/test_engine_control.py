"""Pause / resume / flush / abort and the weight-update calls of SGLangClient, on the real server.

Every test leaves the shared server as it found it: generation resumed, original weights loaded.
"""
from __future__ import annotations

import asyncio
import math
import shutil
import threading

import pytest
import torch

from megarl.rollout.client import SGLangClient
from megarl.testing.engine_state import wait_for_load, wait_idle

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(40, 90))
LONG = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}


async def _wait_running(url: str, task: asyncio.Task, timeout_s: float = 60.0):
    """Wait until the server's running batch holds the request (``/v1/loads``), which is still unfinished."""
    await wait_for_load(url, lambda load: load["num_running_reqs"] >= 1, timeout_s=timeout_s,
                        what="running the request")
    assert not task.done(), task.result()


def _teacher_forced(model, prompt, output_ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logprobs[torch.arange(len(output_ids)), torch.tensor(output_ids)]


async def test_pause_retract_holds_new_requests_until_resume(sglang_url):
    async with SGLangClient(sglang_url) as client:
        await client.pause("retract")
        try:
            task = asyncio.ensure_future(client.generate(PROMPT, {"max_new_tokens": 8,
                                                                  "ignore_eos": True}))
            await asyncio.sleep(2.0)  # a window: SGLang holds it before its queues, out of /v1/loads
            assert not task.done(), "a paused engine generated"
        finally:
            await client.resume()
        out = await asyncio.wait_for(task, 60)
    assert out.finish_reason == "length" and len(out.output_ids) == 8


async def test_a_paused_engine_fails_health_but_is_reachable(sglang_url):
    """Why the router decides "dead" with ``reachable`` (``/model_info``) and not SGLang's ``/health``:
    the latter generates a token, so it fails on a paused engine that is alive (async weight updates)."""
    async with SGLangClient(sglang_url) as client:
        assert await client.health(timeout_s=10.0) and await client.reachable(timeout_s=10.0)
        await client.pause("retract")
        try:
            assert not await client.health(timeout_s=4.0)
            assert await client.reachable(timeout_s=4.0)
        finally:
            await client.resume()
        assert await client.health(timeout_s=30.0)


async def test_pause_abort_returns_running_requests(sglang_engine):
    async with SGLangClient(sglang_engine.url) as client:
        task = asyncio.ensure_future(client.generate(PROMPT, LONG))
        await _wait_running(sglang_engine.url, task)
        try:
            await client.pause("abort")
            out = await asyncio.wait_for(task, 60)
        finally:
            await client.resume()
        assert out.finish_reason == "abort"
        assert len(out.output_ids) < LONG["max_new_tokens"]
        assert len(out.output_logprobs) == len(out.output_ids)
        after = await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
    assert after.finish_reason == "length"


async def test_abort_by_rid_and_on_cancel(sglang_engine):
    async with SGLangClient(sglang_engine.url) as client:
        task = asyncio.ensure_future(client.generate(PROMPT, LONG, rid="megarl-test-abort"))
        await _wait_running(sglang_engine.url, task)
        await client.abort("megarl-test-abort")
        out = await asyncio.wait_for(task, 60)
        assert out.finish_reason == "abort" and len(out.output_ids) < LONG["max_new_tokens"]

        # Cancelling the caller aborts the request on the engine: the engine is idle again soon,
        # so a pause in in_place mode followed by a flush (which needs no running request) works.
        task = asyncio.ensure_future(client.generate(PROMPT, LONG))
        await _wait_running(sglang_engine.url, task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(sglang_engine.url)
        await client.flush_cache(timeout_s=20.0)


async def test_flush_while_a_request_is_retracted_then_it_continues(sglang_engine):
    """Async RL: a weight sync pauses (retract) with requests in flight and flushes the cache.
    SGLang's deferred flush waits for an empty waiting queue, where the retracted request sits, so
    it times out; the paused flush (immediate attempts) succeeds and the request then finishes."""
    from megarl.rollout.client import EngineRequestError

    # Long enough to be still decoding when the pause lands: an engine that is not sharing its
    # cores with idle spinning servers decodes 64 tokens of the tiny model in well under a second.
    params = {"max_new_tokens": 1024, "temperature": 1.0, "ignore_eos": True}
    async with SGLangClient(sglang_engine.url) as client:
        task = asyncio.ensure_future(client.generate(PROMPT, params))
        await _wait_running(sglang_engine.url, task)
        await client.pause("retract")
        try:
            with pytest.raises(EngineRequestError, match="idle"):
                await client.flush_cache(timeout_s=2.0)  # the deferred path: what megarl avoids
            await client.flush_cache(timeout_s=20.0, paused=True)
        finally:
            await client.resume()
        out = await asyncio.wait_for(task, 120)
    assert out.finish_reason == "length" and len(out.output_ids) == params["max_new_tokens"]


async def test_flush_cache_empties_prefix_cache(sglang_url):
    prompt = list(range(300, 420))
    async with SGLangClient(sglang_url) as client:
        await client.generate(prompt, {"max_new_tokens": 1})
        hit = await client.generate(prompt, {"max_new_tokens": 1})
        await client.flush_cache()
        miss = await client.generate(prompt, {"max_new_tokens": 1})
    assert hit.cached_tokens >= len(prompt) - 1
    assert miss.cached_tokens == 0


@pytest.fixture
def perturbed_model_dir(tiny_moe_dir, tmp_path):
    """A copy of the tiny model with every checkpoint tensor perturbed (new policy weights)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "perturbed"
    shutil.copytree(tiny_moe_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
               for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


async def _restore(client: SGLangClient, model_dir, version: str | None) -> None:
    await client.update_weights_from_disk(str(model_dir), weight_version=version)


async def test_update_weights_from_disk(sglang_url, tiny_moe_dir, tiny_moe_hf, perturbed_model_dir):
    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(perturbed_model_dir, dtype=torch.float32).eval()
    async with SGLangClient(sglang_url) as client:
        original_version = await client.get_weight_version()
        try:
            await client.update_weights_from_disk(str(perturbed_model_dir), weight_version="disk-v2")
            assert await client.get_weight_version() == "disk-v2"
            out = await client.generate(PROMPT, {"max_new_tokens": 16, "ignore_eos": True})
        finally:
            await _restore(client, tiny_moe_dir, original_version)
        restored = await client.generate(PROMPT, {"max_new_tokens": 16, "ignore_eos": True})
    assert out.weight_version == "disk-v2"
    gap_new = (_teacher_forced(new_model, PROMPT, out.output_ids)
               - torch.tensor(out.output_logprobs)).abs().max().item()
    gap_old = (_teacher_forced(tiny_moe_hf[0], PROMPT, out.output_ids)
               - torch.tensor(out.output_logprobs)).abs().max().item()
    assert gap_new < 5e-3 < gap_old
    gap_restored = (_teacher_forced(tiny_moe_hf[0], PROMPT, restored.output_ids)
                    - torch.tensor(restored.output_logprobs)).abs().max().item()
    assert gap_restored < 5e-3


async def test_update_weights_from_tensor_in_session(sglang_url, tiny_moe_dir, tiny_moe_hf):
    model = tiny_moe_hf[0]
    vocab, hidden = model.lm_head.weight.shape
    zeros = [("lm_head.weight", torch.zeros(vocab, hidden))]
    async with SGLangClient(sglang_url) as client:
        original_version = await client.get_weight_version()
        try:
            await client.begin_weight_update()
            await client.update_weights_from_tensor([zeros], weight_version="zero-head")
            await client.end_weight_update()
            out = await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
        finally:
            await _restore(client, tiny_moe_dir, original_version)
    # A zero LM head gives every token the same logit: logprob = -log(V) exactly.
    assert out.weight_version == "zero-head"
    assert all(abs(lp + math.log(vocab)) < 1e-4 for lp in out.output_logprobs)


async def test_update_weights_from_distributed_gloo(sglang_url, tiny_moe_dir, tiny_moe_hf):
    import torch.distributed as dist
    from sglang.srt.utils import init_custom_process_group

    from megarl.procs.ports import find_free_port

    model = tiny_moe_hf[0]
    head = torch.zeros_like(model.lm_head.weight)
    port = find_free_port()
    group_name = f"megarl_test_{port}"
    async with SGLangClient(sglang_url) as client:
        original_version = await client.get_weight_version()
        joined: dict = {}
        # The trainer side (group rank 0) and the engine (rank 1) must join at the same time.
        joiner = threading.Thread(target=lambda: joined.update(group=init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
            group_name=group_name)))
        joiner.start()
        await client.init_weights_update_group(master_address="127.0.0.1", master_port=port,
                                               rank_offset=1, world_size=2,
                                               group_name=group_name, backend="gloo")
        joiner.join(30)
        try:
            await client.begin_weight_update()
            update = asyncio.ensure_future(client.update_weights_from_distributed(
                ["lm_head.weight"], ["float32"], [list(head.shape)], group_name=group_name,
                weight_version="dist-v1"))
            await asyncio.to_thread(dist.broadcast, head, 0, group=joined["group"])
            await update
            await client.end_weight_update()
            out = await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
            await client.destroy_weights_update_group(group_name)
        finally:
            dist.destroy_process_group(joined["group"])
            await _restore(client, tiny_moe_dir, original_version)
    assert out.weight_version == "dist-v1"
    assert all(abs(lp + math.log(head.shape[0])) < 1e-4 for lp in out.output_logprobs)


async def test_release_and_resume_memory_occupation(sglang_url):
    async with SGLangClient(sglang_url) as client:
        before = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0})
        await client.pause("retract")
        try:
            await client.release_memory_occupation()
            await client.resume_memory_occupation()
        finally:
            await client.resume()
        after = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0})
    assert after.output_ids == before.output_ids
    assert max(abs(a - b) for a, b in zip(after.output_logprobs, before.output_logprobs)) < 1e-5
