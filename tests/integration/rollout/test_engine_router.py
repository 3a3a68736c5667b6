"""Router over two real SGLang CPU servers: session affinity, and killing one engine mid-batch."""
from __future__ import annotations

import asyncio
import random

import pytest

from megarl.rollout.client import SGLangClient
from megarl.rollout.router import Router
from megarl.testing.engine_state import set_forward_sleep

pytestmark = pytest.mark.timeout(420)

OBSERVATION = [5, 6, 7, 8, 9, 10, 11, 12]  # stands in for tool-observation tokens between turns


def _router(engines) -> Router:
    return Router([SGLangClient(e.url, engine_id=e.engine_id) for e in engines])


async def _trajectory(router: Router, session_id: str, prompt: list[int], num_turns: int,
                      sampling_params: dict) -> list:
    """Multi-turn: each turn's input is the previous input + its output + an observation."""
    outputs, input_ids = [], list(prompt)
    for _ in range(num_turns):
        out = await router.generate(input_ids, sampling_params, session_id=session_id)
        outputs.append((list(input_ids), out))
        input_ids = input_ids + out.output_ids + OBSERVATION
    router.end_session(session_id)
    return outputs


async def test_session_affinity_keeps_turns_on_one_engine_with_cache_hits(two_sglang_engines):
    rng = random.Random(0)
    prompts = {f"s{i}": [rng.randrange(20, 2000) for _ in range(64)] for i in range(6)}
    router = _router(two_sglang_engines)
    try:
        results = await asyncio.gather(*(
            _trajectory(router, sid, p, 3, {"max_new_tokens": 16, "ignore_eos": True})
            for sid, p in prompts.items()))
        by_id = {c.engine_id: c for c in router.clients}
        # The second turn of session 0 sent to the *other* engine finds no cached history there.
        (_, first), (second_input, second) = results[0][:2]
        other = next(c for eid, c in by_id.items() if eid != first.engine_id)
        elsewhere = await other.generate(second_input, {"max_new_tokens": 1})
    finally:
        await router.close()

    engines_used = set()
    for turns in results:
        engine_ids = {out.engine_id for _, out in turns}
        assert len(engine_ids) == 1, f"a session's turns went to {engine_ids}"
        engines_used |= engine_ids
        for (prev_input, prev_out), (_, out) in zip(turns, turns[1:]):
            # Everything the engine saw before (previous input and output) is served from cache.
            assert out.cached_tokens >= len(prev_input) + len(prev_out.output_ids) - 1
    assert engines_used == {e.engine_id for e in two_sglang_engines}, "load was not spread"
    assert elsewhere.cached_tokens < len(prompts["s0"]) // 2


async def test_killing_one_engine_mid_batch_loses_and_duplicates_nothing(two_sglang_engines):
    victim = two_sglang_engines[1]
    rng = random.Random(1)
    num_sessions, num_turns, num_new = 10, 2, 400
    sampling = {"max_new_tokens": num_new, "ignore_eos": True, "temperature": 1.0}
    prompts = {f"k{i}": [rng.randrange(20, 2000) for _ in range(32)] for i in range(num_sessions)}
    router = _router(two_sglang_engines)
    victim_slot = next(s for s in router.slots if s.client.engine_id == victim.engine_id)
    # The victim sleeps before every forward until it dies, so no first turn it got (400 steps, over 8 s)
    # can finish before the kill on any machine; its restart below comes back at full speed.
    await set_forward_sleep(victim.url, 0.02)
    try:
        tasks = {sid: asyncio.ensure_future(_trajectory(router, sid, p, num_turns, sampling))
                 for sid, p in prompts.items()}
        # Kill the engine while it is decoding first turns.
        deadline = asyncio.get_running_loop().time() + 120
        while victim_slot.num_outstanding < num_sessions // 2 - 1:
            assert asyncio.get_running_loop().time() < deadline, "victim never got requests"
            await asyncio.sleep(0.05)
        assert victim_slot.num_outstanding > 0  # all still decoding: the victim is slowed down
        in_flight_at_kill = victim_slot.num_outstanding
        await asyncio.to_thread(victim.kill)
        results = await asyncio.wait_for(asyncio.gather(*tasks.values()), 300)
    finally:
        await router.close()
        if victim.is_alive():  # failed before the kill: the session engine goes back to full speed
            await set_forward_sleep(victim.url, None)

    assert set(tasks) == set(prompts)
    for turns in results:
        assert len(turns) == num_turns  # every turn answered exactly once
        for _, out in turns:
            assert out.finish_reason == "length" and len(out.output_ids) == num_new
            assert len(out.output_logprobs) == num_new
    assert router.num_rerouted >= in_flight_at_kill
    assert not victim_slot.alive
    assert all(out.engine_id != victim.engine_id for turns in results for _, out in turns[1:])

    # Restart the dead engine; once re-admitted, the router sends it traffic again.
    await asyncio.to_thread(victim.restart, 240)
    router.mark_alive(victim.engine_id)
    try:
        outs = await asyncio.gather(*(router.generate(prompts[f"k{i}"], {"max_new_tokens": 4},
                                                      session_id=f"after{i}") for i in range(2)))
    finally:
        await router.close()
    assert {o.engine_id for o in outs} == {e.engine_id for e in two_sglang_engines}
