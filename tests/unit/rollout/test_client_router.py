"""Router policy (affinity, least outstanding, failover) with recording engine doubles.

The doubles implement only the client methods the router calls (generate, health, abort, pause,
...); the router over real SGLang servers is tested in tests/integration/rollout/test_engine_router.py.
"""
from __future__ import annotations

import asyncio

import pytest

from megarl.rollout.client import EngineConnectionLost, EngineRequestError, EngineTimeoutError, EngineUnavailableError
from megarl.rollout.router import Router
from megarl.rollout.types import GenerateOutput, RolloutEngine

pytestmark = pytest.mark.timeout(30)


class EngineDouble:
    def __init__(self, engine_id: str, delay_s: float = 0.0):
        self.engine_id = engine_id
        self.delay_s = delay_s
        self.healthy = True
        self.generating = True  # SGLang's /health generates a token: it fails while generation is paused
        self.fail_next: list[Exception] = []
        self.calls: list[tuple[list[int], str]] = []
        self.aborted: list[str] = []
        self.paused: list[str] = []
        self.gate: asyncio.Event | None = None

    async def generate(self, input_ids, sampling_params, *, return_routed_experts=False, rid=None,
                       session_id=None):
        self.calls.append((list(input_ids), rid))
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.delay_s)
        if self.fail_next:
            raise self.fail_next.pop(0)
        return GenerateOutput(output_ids=[len(input_ids)], output_logprobs=[-1.0],
                              finish_reason="stop", engine_id=self.engine_id)

    async def health(self, timeout_s=5.0):
        return self.healthy and self.generating

    async def reachable(self, timeout_s=5.0):
        return self.healthy

    async def abort(self, rid=None, *, abort_all=False):
        self.aborted.append(rid)

    async def pause(self, mode="retract"):
        if not self.healthy:
            raise EngineUnavailableError("down")
        self.paused.append(mode)

    async def resume(self):
        pass

    async def flush_cache(self):
        pass

    async def close(self):
        pass


def test_router_is_a_rollout_engine():
    assert isinstance(Router([EngineDouble("a")]), RolloutEngine)
    with pytest.raises(ValueError, match="unique"):
        Router([EngineDouble("a"), EngineDouble("a")])


async def test_sessions_stick_and_new_sessions_go_to_least_loaded():
    a, b = EngineDouble("a", delay_s=0.05), EngineDouble("b", delay_s=0.05)
    router = Router([a, b])
    first = await asyncio.gather(*(router.generate([1], {}, session_id=f"s{i}") for i in range(6)))
    assert sorted(o.engine_id for o in first) == ["a"] * 3 + ["b"] * 3
    again = await asyncio.gather(*(router.generate([1, 2], {}, session_id=f"s{i}") for i in range(6)))
    assert [o.engine_id for o in again] == [o.engine_id for o in first]

    a.gate = asyncio.Event()  # a is busy: a new session goes to b
    num_calls = len(a.calls)
    busy = asyncio.ensure_future(router.generate([1], {}, session_id="s0"))

    async def busy_reached_a():
        while len(a.calls) == num_calls:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(busy_reached_a(), 10)  # it now waits at a's gate
    assert (await router.generate([1], {}, session_id="new")).engine_id == "b"
    a.gate.set()
    assert (await busy).engine_id == "a"
    router.end_session("s0")
    assert router.engine_of("s0") is None


async def test_dead_engine_is_drained_and_its_turns_rerouted_once():
    a, b = EngineDouble("a"), EngineDouble("b")
    router = Router([a, b])
    await router.generate([1], {}, session_id="s")  # pinned to a
    pinned = router.engine_of("s")
    victim, survivor = (a, b) if pinned == "a" else (b, a)
    victim.healthy = False
    victim.fail_next = [EngineConnectionLost("killed")]
    out = await router.generate([1, 2, 3], {}, session_id="s")
    assert out.engine_id == survivor.engine_id and out.output_ids == [3]
    assert router.num_rerouted == 1 and router.engine_of("s") == survivor.engine_id
    assert len(victim.calls) == 2 and len(survivor.calls) == 1  # the turn ran once on the survivor
    await router.generate([1], {}, session_id="other")
    assert len(victim.calls) == 2  # no new traffic to the dead engine
    assert router.metrics()["router/alive_engines"] == 1

    router.mark_alive(victim.engine_id)
    victim.healthy = True
    await asyncio.gather(*(router.generate([1], {}, session_id=f"n{i}") for i in range(2)))
    assert len(victim.calls) == 3


async def test_lost_connection_to_healthy_engine_aborts_then_resends():
    a = EngineDouble("a")
    a.fail_next = [EngineConnectionLost("reset")]
    router = Router([a])
    out = await router.generate([1], {}, session_id="s")
    assert out.engine_id == "a" and router.num_rerouted == 1
    first_rid = a.calls[0][1]
    assert a.aborted == [first_rid] and a.calls[1][1] != first_rid


async def test_errors_that_are_not_engine_loss_propagate():
    a = EngineDouble("a")
    a.fail_next = [EngineRequestError("/generate", 400, "bad sampling params")]
    router = Router([a])
    with pytest.raises(EngineRequestError):
        await router.generate([1], {})
    a.fail_next = [EngineTimeoutError("slow")]  # slow but healthy: not re-sent
    with pytest.raises(EngineTimeoutError):
        await router.generate([1], {})
    assert router.num_rerouted == 0


async def test_all_engines_dead_raises():
    a, b = EngineDouble("a"), EngineDouble("b")
    for e in (a, b):
        e.healthy = False
        e.fail_next = [EngineUnavailableError("refused")]
    router = Router([a, b])
    with pytest.raises(EngineUnavailableError, match="no live engine"):
        await router.generate([1], {}, session_id="s")


async def test_pause_broadcast_marks_unreachable_engines_dead():
    a, b = EngineDouble("a"), EngineDouble("b")
    b.healthy = False
    router = Router([a, b])
    await router.pause("abort")
    assert a.paused == ["abort"] and router.alive_clients() == [a]


async def test_an_engine_is_admitted_only_when_it_reports_the_current_weight_version():
    a, b = EngineDouble("a"), EngineDouble("b")
    versions = {"a": "7", "b": "3"}  # b restarted: it serves its launch weights

    async def version_of(engine):
        return versions[engine.engine_id]

    for engine in (a, b):
        engine.get_weight_version = lambda engine=engine: version_of(engine)
    router = Router([a, b])
    router.mark_dead("b", "restarting")
    assert not await router.admit("b", "7")
    await asyncio.gather(*(router.generate([1], {}, session_id=f"s{i}") for i in range(4)))
    assert len(b.calls) == 0 and len(a.calls) == 4  # nothing served with stale weights
    versions["b"] = "7"  # re-synced
    assert await router.admit("b", "7")
    await asyncio.gather(*(router.generate([1], {}, session_id=f"t{i}") for i in range(4)))
    assert len(b.calls) > 0
    versions["a"] = "6"  # a confirmed version that is not current takes it out of service too
    assert not await router.admit("a", "7") and router.metrics()["router/alive_engines"] == 1


async def test_lost_connection_to_a_paused_engine_does_not_mark_it_dead():
    """A paused engine (weight update in async mode) fails SGLang's /health, which generates a token;
    the router decides on reachability, so the engine stays in service and the turn is re-sent."""
    a = EngineDouble("a")
    a.generating = False
    a.fail_next = [EngineConnectionLost("write failed on a closing keep-alive connection")]
    router = Router([a])
    out = await router.generate([1], {}, session_id="s")
    assert out.engine_id == "a" and router.metrics()["router/alive_engines"] == 1
