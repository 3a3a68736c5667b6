"""SGLangClient's own logic: request shape, response parsing, retry/timeout/abort policy.

The HTTP peer here is a small aiohttp app that records requests and answers with SGLang's response
shape (as observed from the real server, see tests/integration/rollout); it exercises only the
client's transport decisions. Behaviour against the real SGLang server is tested in
tests/integration/rollout/test_engine_*.py.
"""
from __future__ import annotations

import asyncio
import base64
import struct

import pytest
import torch
from aiohttp import web

from megarl.procs.ports import find_free_port
from megarl.rollout.client import (
    EngineConnectionLost,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    SGLangClient,
    decode_routed_experts,
)

pytestmark = pytest.mark.timeout(60)


class Peer:
    """An aiohttp server on 127.0.0.1 recording (path, json) of every request."""

    def __init__(self, generate_handler=None):
        self.requests: list[tuple[str, object]] = []
        self.port = find_free_port()
        self.generate_handler = generate_handler or self.ok_generate
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def record(self, request: web.Request):
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, body))
        return body

    async def ok_generate(self, request: web.Request, body):
        n = body["sampling_params"].get("max_new_tokens", 3)
        return web.json_response({"output_ids": list(range(7, 7 + n)), "meta_info": {
            "finish_reason": {"type": "length", "length": n}, "cached_tokens": 5,
            "weight_version": "v3",
            "output_token_logprobs": [[-0.5 - i, 7 + i, None] for i in range(n)]}})

    async def start(self):
        async def generate(request):
            return await self.generate_handler(request, await self.record(request))

        async def other(request):
            await self.record(request)
            return web.json_response({"success": True, "message": "ok"})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/{tail:.*}", other)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self):
        await self.runner.cleanup()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    async def received(self, path: str, rid: str, timeout_s: float = 10.0) -> None:
        """Wait until a request to ``path`` for ``rid`` has arrived (polled every 10 ms)."""
        async def arrived():
            while not any(p == path and isinstance(b, dict) and b.get("rid") == rid for p, b in self.requests):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(arrived(), timeout_s)


def test_decode_routed_experts_is_little_endian_row_major():
    values = list(range(2 * 3 * 2))  # rows=2, L=3, K=2
    data = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
    decoded = decode_routed_experts(data, num_layers=3, topk=2)
    assert decoded.dtype == torch.int32 and decoded.shape == (2, 3, 2)
    assert decoded[1, 2, 0].item() == 1 * 6 + 2 * 2 + 0
    with pytest.raises(ValueError, match="multiple"):
        decode_routed_experts(base64.b64encode(b"\0" * 20).decode(), num_layers=3, topk=2)


async def test_generate_request_and_parsed_output():
    peer = await Peer().start()
    sampling = {"max_new_tokens": 3, "temperature": 1.0}
    try:
        async with SGLangClient(peer.url, engine_id="e0") as client:
            out = await client.generate([1, 2, 3], sampling, session_id="ignored")
    finally:
        await peer.stop()
    path, body = peer.requests[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3]
    assert body["return_logprob"] is True and body["rid"] and "return_routed_experts" not in body
    assert sampling == {"max_new_tokens": 3, "temperature": 1.0}  # not mutated
    assert out.output_ids == [7, 8, 9] and out.output_logprobs == [-0.5, -1.5, -2.5]
    assert (out.finish_reason, out.cached_tokens, out.weight_version, out.engine_id) == (
        "length", 5, "v3", "e0")


async def test_connection_refused_is_retried_until_the_server_is_up():
    peer = Peer()

    async def start_later():
        await asyncio.sleep(0.4)
        await peer.start()

    starter = asyncio.ensure_future(start_later())
    try:
        async with SGLangClient(peer.url, max_connect_retries=5, retry_backoff_s=0.1) as client:
            out = await client.generate([1], {"max_new_tokens": 2})
    finally:
        await starter
        await peer.stop()
    assert out.output_ids == [7, 8]
    assert peer.paths() == ["/generate"]  # delivered exactly once


async def test_unreachable_engine_raises_after_retries():
    async with SGLangClient(f"http://127.0.0.1:{find_free_port()}", max_connect_retries=2,
                            retry_backoff_s=0.01) as client:
        with pytest.raises(EngineUnavailableError, match="3 attempts"):
            await client.generate([1], {})
        assert not await client.health(timeout_s=1.0)


async def test_completed_error_response_is_not_retried():
    async def fail(request, body):
        return web.Response(status=500, text="boom")

    peer = await Peer(fail).start()
    try:
        async with SGLangClient(peer.url, max_connect_retries=3) as client:
            with pytest.raises(EngineRequestError, match="boom") as info:
                await client.generate([1], {})
    finally:
        await peer.stop()
    assert info.value.status == 500 and peer.paths() == ["/generate"]


async def test_connection_lost_mid_request_is_not_retried():
    async def drop(request, body):
        request.transport.close()
        await asyncio.sleep(0.2)

    peer = await Peer(drop).start()
    try:
        async with SGLangClient(peer.url, max_connect_retries=3) as client:
            with pytest.raises(EngineConnectionLost):
                await client.generate([1], {})
    finally:
        await peer.stop()
    assert peer.paths() == ["/generate"]


async def test_timeout_and_cancellation_abort_the_request_on_the_engine():
    async def hang(request, body):
        await asyncio.sleep(30)

    peer = await Peer(hang).start()
    try:
        async with SGLangClient(peer.url, request_timeout_s=0.3) as client:
            with pytest.raises(EngineTimeoutError):
                await client.generate([1], {}, rid="r-timeout")
            task = asyncio.ensure_future(client.generate([1], {}, rid="r-cancel"))
            await peer.received("/generate", "r-cancel")  # in flight on the engine
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for rid in ("r-timeout", "r-cancel"):  # the aborts are sent in the background
                await peer.received("/abort_request", rid)
    finally:
        await peer.stop()
    aborts = [body["rid"] for path, body in peer.requests if path == "/abort_request"]
    assert sorted(aborts) == ["r-cancel", "r-timeout"]


async def test_control_calls_hit_sglang_endpoints_with_bodies():
    peer = await Peer().start()
    try:
        async with SGLangClient(peer.url) as client:
            await client.pause("abort")
            await client.resume()
            await client.begin_weight_update()
            await client.update_weights_from_tensor(["payload-rank0", "payload-rank1"],
                                                    load_format="m.loader", weight_version="7")
            await client.end_weight_update()
            await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]],
                                                         group_name="g", weight_version="8")
            await client.init_weights_update_group(master_address="h", master_port=1, rank_offset=1,
                                                   world_size=3, backend="gloo")
            with pytest.raises(ValueError, match="pause mode"):
                await client.pause("stop")
    finally:
        await peer.stop()
    bodies = dict(peer.requests)
    assert bodies["/pause_generation"] == {"mode": "abort"}
    assert bodies["/update_weights_from_tensor"]["serialized_named_tensors"] == [
        "payload-rank0", "payload-rank1"]
    assert bodies["/update_weights_from_tensor"]["load_format"] == "m.loader"
    assert bodies["/update_weights_from_distributed"]["shapes"] == [[2, 3]]
    assert bodies["/init_weights_update_group"]["backend"] == "gloo"
    assert peer.paths().index("/begin_weight_update") < peer.paths().index(
        "/update_weights_from_tensor") < peer.paths().index("/end_weight_update")


async def test_unsuccessful_weight_update_raises():
    peer = Peer()

    async def refuse(request):
        await peer.record(request)
        return web.json_response({"success": False, "message": "no session"})

    app = web.Application()
    app.router.add_post("/update_weights_from_disk", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", peer.port).start()
    try:
        async with SGLangClient(peer.url) as client:
            with pytest.raises(EngineRequestError, match="no session"):
                await client.update_weights_from_disk("/m")
    finally:
        await runner.cleanup()
