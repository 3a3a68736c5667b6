"""Async HTTP client for one SGLang server (the production :class:`RolloutEngine`).

It speaks SGLang's native API: ``/generate`` with token ids in and token ids + logprobs out, and
the control endpoints for pausing, cache flushing, aborting and weight updates (docs/architecture.md,
"Interfaces").

Failure policy:

- A connection that cannot be opened (refused, unreachable, DNS, connect timeout) is retried with
  exponential backoff: the request never reached the server, so a retry cannot duplicate it.
- A request that reached the server is never re-sent by the client. If the connection drops
  mid-request the client raises :class:`EngineConnectionLost`; the router decides what to do.
- An HTTP error status raises :class:`EngineRequestError` (not retried).
- A generate request that times out or whose caller is cancelled is aborted on the server
  (``/abort_request`` with its ``rid``), so the engine stops spending compute on it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp

from megarl.rollout.client_weights import WeightUpdateEndpoints
from megarl.rollout.engine_errors import (  # noqa: F401  (EngineError and the others: part of this interface)
    EngineConnectionLost,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from megarl.rollout.payloads import (  # noqa: F401  (re-exported)
    REBUILD_CUDA_DEVICE_ARG,
    decode_routed_experts,
    device_uuid_args,
    serialize_named_tensors,
)
from megarl.rollout.types import GenerateOutput

log = logging.getLogger(__name__)


class SGLangClient(WeightUpdateEndpoints):
    """Async client of one SGLang server; implements :class:`megarl.rollout.types.RolloutEngine`.

    Transport, generation and control are here; the weight-update endpoints come from
    :class:`~megarl.rollout.client_weights.WeightUpdateEndpoints`.

    Args:
        url: ``http://host:port`` of the server.
        engine_id: name reported in :attr:`GenerateOutput.engine_id` (default: the URL).
        request_timeout_s: seconds before a generate (or control) request is abandoned.
        connect_timeout_s: seconds to open one connection.
        max_connect_retries: retries after a failed connection attempt (0 = none).
        retry_backoff_s: first retry delay; doubled per retry.
        routed_experts_layout: ``(num_layers, topk)`` to decode routed experts; None reads them
            from the served model's ``config.json`` on first use.
        max_connections: concurrent connections to this server.
    """

    def __init__(self, url: str, *, engine_id: str | None = None, request_timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_connect_retries: int = 3,
                 retry_backoff_s: float = 0.5, routed_experts_layout: tuple[int, int] | None = None,
                 max_connections: int = 1024) -> None:
        self.url = url.rstrip("/")
        self.engine_id = engine_id or self.url
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connect_retries = max_connect_retries
        self.retry_backoff_s = retry_backoff_s
        self.routed_experts_layout = routed_experts_layout
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ transport
    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session is bound to its event loop; tests (and Ray actors) may use several loops.
            self._session = aiohttp.ClientSession(
                # Idle connections are dropped before uvicorn's 5 s keep-alive closes them, so a
                # request is never written into a connection the server is closing.
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=4.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s))
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _request(self, method: str, path: str, payload: Any = None, *,
                       timeout_s: float | None = None, expect_json: bool = True) -> Any:
        """Send one request, retrying only connection failures; see the module docstring.

        Raises:
            EngineUnavailableError: no connection after the retries.
            EngineConnectionLost: the connection dropped after the request was sent.
            EngineTimeoutError: no response within ``timeout_s``.
            EngineRequestError: HTTP error status.
        """
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s,
                                        sock_connect=self.connect_timeout_s)
        delay = self.retry_backoff_s
        for attempt in range(self.max_connect_retries + 1):
            try:
                async with self._get_session().request(method, self.url + path, json=payload,
                                                       timeout=timeout) as resp:
                    body = await resp.read()
                    if resp.status >= 400:
                        raise EngineRequestError(path, resp.status, body.decode("utf-8", "replace"))
                    if not expect_json:
                        return body.decode("utf-8", "replace")
                    return json.loads(body) if body else None
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # Not connected, so nothing was sent: safe to retry.
                if attempt == self.max_connect_retries:
                    raise EngineUnavailableError(f"{self.engine_id}: cannot connect to {self.url} "
                                                 f"after {attempt + 1} attempts: {exc}") from exc
                log.debug("%s: connect failed (%s); retry in %.2f s", self.engine_id, exc, delay)
                await asyncio.sleep(delay)
                delay *= 2
            except TimeoutError as exc:
                raise EngineTimeoutError(f"{self.engine_id}: {path} got no answer within "
                                         f"{timeout.total} s") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError) as exc:
                raise EngineConnectionLost(f"{self.engine_id}: connection lost during {path}: "
                                           f"{exc!r}") from exc
        raise AssertionError("unreachable")

    async def _post(self, path: str, payload: Any = None, **kwargs) -> Any:
        return await self._request("POST", path, {} if payload is None else payload, **kwargs)

    async def _post_checked(self, path: str, payload: Any, **kwargs) -> dict:
        """POST to an endpoint that answers ``{"success": bool, "message": str}``."""
        result = await self._post(path, payload, **kwargs)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineRequestError(path, 200, json.dumps(result))
        return result

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                       return_routed_experts: bool = False, session_id: str | None = None,
                       return_logprob: bool = True, routed_experts_start_len: int = 0,
                       rid: str | None = None) -> GenerateOutput:
        """Generate one turn from token ids.

        Args:
            input_ids: ``[P]`` prompt token ids.
            sampling_params: SGLang sampling parameters (``max_new_tokens``, ``temperature``,
                ``top_p``, ``stop``, ``regex``, ``json_schema``, ...); not modified.
            return_routed_experts: also return the routed experts (server launched with
                ``--enable-return-routed-experts``).
            session_id: ignored by a single engine (it is the router's affinity key).
            return_logprob: return the logprob of each output token.
            routed_experts_start_len: first position whose routing is returned (0 = all).
            rid: request id on the server (default: a fresh uuid); see :meth:`abort`.

        Returns:
            :class:`GenerateOutput` with ``output_ids [N]``, ``output_logprobs [N]`` (empty if not
            requested), ``finish_reason`` (``stop`` | ``length`` | ``abort``), ``cached_tokens``,
            ``weight_version`` and, if requested, ``routed_experts [P + N - 1 - start, L, K]`` int32
            (also for a request aborted while running: SGLang 0.5.23 finishes it after one more
            forward and collects its routes as a finished one's; None for one aborted while it
            waited in the queue, which ran no forward).

        Raises:
            EngineError: see :meth:`_request`. Cancellation aborts the request on the server.
        """
        rid = rid or uuid.uuid4().hex
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                   "return_logprob": return_logprob, "rid": rid}
        if return_routed_experts:
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = routed_experts_start_len
        try:
            result = await self._post("/generate", payload)
        except (asyncio.CancelledError, EngineTimeoutError):
            self._abort_in_background(rid)
            raise
        return await self._parse_generate(result, return_routed_experts)

    async def _parse_generate(self, result: dict, return_routed_experts: bool) -> GenerateOutput:
        meta = result["meta_info"]
        logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        routed = None
        finish = meta.get("finish_reason") or {}
        aborted = (finish.get("type") if isinstance(finish, dict) else str(finish)) == "abort"
        if return_routed_experts:
            if meta.get("routed_experts") is not None:
                num_layers, topk = await self._routed_experts_layout()
                routed = decode_routed_experts(meta["routed_experts"], num_layers, topk)
            elif not aborted:  # a request aborted in SGLang's waiting queue ran no forward: no routes
                raise EngineRequestError("/generate", 200, "no routed_experts in the response; "
                                         "launch the engine with --enable-return-routed-experts")
        return GenerateOutput(
            output_ids=list(result["output_ids"]), output_logprobs=logprobs,
            finish_reason=finish.get("type", "abort") if isinstance(finish, dict) else str(finish),
            routed_experts=routed, cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=meta.get("weight_version"), engine_id=self.engine_id)

    async def _routed_experts_layout(self) -> tuple[int, int]:
        if self.routed_experts_layout is None:
            info = await self.model_info()
            with open(f"{info['model_path']}/config.json", encoding="utf-8") as fh:
                hf_config = json.load(fh)
            text_config = hf_config.get("text_config", hf_config)
            self.routed_experts_layout = (int(text_config["num_hidden_layers"]),
                                          int(text_config["num_experts_per_tok"]))
        return self.routed_experts_layout

    def _abort_in_background(self, rid: str) -> None:
        async def abort() -> None:
            try:
                await self.abort(rid)
            except Exception as exc:  # noqa: BLE001 - best effort: the engine may be gone
                log.debug("%s: abort of %s failed: %r", self.engine_id, rid, exc)

        try:
            asyncio.get_running_loop().create_task(abort())
        except RuntimeError:
            pass

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request (by ``rid``) or all; aborted requests return ``finish_reason="abort"``."""
        if rid is None and not abort_all:
            raise ValueError("abort() needs a rid or abort_all=True")
        await self._post("/abort_request", {"rid": rid or "", "abort_all": abort_all},
                         expect_json=False, timeout_s=30.0)

    # ------------------------------------------------------------------ control
    async def health(self, timeout_s: float = 5.0) -> bool:
        """``/health`` answered 200 within ``timeout_s`` (never raises; no retries)."""
        try:
            session = self._get_session()
            async with session.get(self.url + "/health",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def reachable(self, timeout_s: float = 5.0) -> bool:
        """The server process answers HTTP (``/model_info``, 200) within ``timeout_s``; never raises.

        Unlike :meth:`health` this needs no generation: SGLang 0.5.23's ``/health`` runs a one-token
        request and waits for the scheduler (at least 1 s), so a paused engine (a weight update in
        async mode) or a busy one fails it although it is alive. The router decides "dead" with this.
        """
        try:
            session = self._get_session()
            async with session.get(self.url + "/model_info",
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def model_info(self) -> dict:
        """``/model_info``: model_path, weight_version, tool_call_parser, ..."""
        return await self._request("GET", "/model_info", timeout_s=30.0)

    async def get_weight_version(self) -> str | None:
        """The engine's current weight version string."""
        return (await self.model_info()).get("weight_version")

    async def pause(self, mode: str = "retract") -> None:
        """Pause generation: ``retract`` (running requests go back to the queue and resume later),
        ``abort`` (they return now with ``finish_reason="abort"``) or ``in_place`` (kept as is)."""
        if mode not in ("retract", "abort", "in_place"):
            raise ValueError(f"pause mode must be retract | abort | in_place, got {mode!r}")
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Continue generation after :meth:`pause`."""
        await self._post("/continue_generation", {})

    async def flush_cache(self, timeout_s: float = 30.0, *, paused: bool = False) -> None:
        """Empty the prefix (radix) cache, waiting up to ``timeout_s`` for running requests.

        Args:
            timeout_s: how long the engine may wait for its running requests to end.
            paused: generation is paused (a weight update). SGLang 0.5.23's deferred flush
                (``timeout > 0``) waits for an empty *waiting* queue too, which a ``retract`` pause
                keeps full (the retracted requests wait there, without KV, to resume): it would time
                out whenever requests are in flight (async RL). Its immediate flush (``timeout=0``)
                ignores the waiting queue of a paused engine, so a paused engine is flushed with
                immediate attempts, retried until the running batch has drained or ``timeout_s``.

        Raises:
            EngineRequestError: the engine refused (requests still running after ``timeout_s``).
        """
        if not paused:
            await self._request("POST", f"/flush_cache?timeout={timeout_s}", None,
                                timeout_s=timeout_s + 30.0, expect_json=False)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._request("POST", "/flush_cache?timeout=0", None, timeout_s=30.0, expect_json=False)
                return
            except EngineRequestError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Release weights and/or KV cache memory (``tags``: ``weights``, ``kv_cache``; None = all)."""
        await self._post("/release_memory_occupation", {"tags": list(tags) if tags else None},
                         expect_json=False)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`release_memory_occupation` released."""
        await self._post("/resume_memory_occupation", {"tags": list(tags) if tags else None},
                         expect_json=False)

    def __repr__(self) -> str:
        return f"SGLangClient({self.engine_id})"
