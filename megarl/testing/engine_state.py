"""What a real SGLang server says about its requests, so that a test waits for a state instead of
sleeping for a duration it hopes is long enough (issue 39).

Three views of SGLang 0.5.23, all its own endpoints:

- :class:`StreamedGeneration`: one ``/generate`` request with ``stream: true``; every chunk the server
  sends carries the tokens produced so far (``meta_info.completion_tokens``) and, in the last one, the
  finish reason. "This request is running and has produced k tokens" is then a fact the server
  reported, not a guess.
- :func:`wait_for_load`: polls ``/v1/loads`` (``num_running_reqs``, ``num_waiting_reqs``: the
  scheduler's running batch and waiting queue) until a predicate holds, for requests a test cannot
  stream (those sent by megarl's own client).
- :func:`slowed_down`: ``/slow_down``, SGLang's testing hook that sleeps before every forward, so that
  requests seen running cannot finish in the few milliseconds before the test's next call on any
  machine, however fast.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

_MAX_CHUNK_BYTES = 1 << 26  # one streamed chunk holds all tokens (and routes) so far: lift aiohttp's 128 KiB line cap


async def _request(method: str, url: str, payload: Any = None, timeout_s: float = 30.0) -> Any:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.request(method, url, json=payload) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {text[:500]}")
            return json.loads(text) if text else None


async def engine_load(url: str) -> dict[str, Any]:
    """The server's ``/v1/loads`` record of DP rank 0 (``num_running_reqs``, ``num_waiting_reqs``, ...).

    Raises:
        RuntimeError: the server answered with an HTTP error.
    """
    answer = await _request("GET", f"{url}/v1/loads?include=core")
    return answer["loads"][0]


async def wait_for_load(url: str, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float,
                        what: str, poll_s: float = 0.05) -> dict[str, Any]:
    """Poll :func:`engine_load` until ``predicate(load)`` holds; return that load.

    Args:
        url: the server's base URL.
        predicate: called with each ``/v1/loads`` record.
        timeout_s: how long to wait, in seconds.
        what: the awaited state, for the error message.
        poll_s: seconds between two polls.

    Raises:
        TimeoutError: the predicate did not hold within ``timeout_s``; the message has the last load.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate(load := await engine_load(url)):
        if loop.time() > deadline:
            raise TimeoutError(f"{url}: not {what} within {timeout_s} s; last /v1/loads: "
                               f"running {load['num_running_reqs']}, waiting {load['num_waiting_reqs']}")
        await asyncio.sleep(poll_s)
    return load


async def wait_idle(url: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the server runs no request and queues none (see :func:`wait_for_load`)."""
    return await wait_for_load(url, lambda load: load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0,
                               timeout_s=timeout_s, what="idle")


async def set_forward_sleep(url: str, forward_sleep_s: float | None) -> None:
    """Make the server sleep ``forward_sleep_s`` seconds before each forward from now on (``/slow_down``);
    None: full speed again.

    Raises:
        ValueError: ``forward_sleep_s`` is not positive.
        RuntimeError: the server answered with an HTTP error.
    """
    if forward_sleep_s is not None and forward_sleep_s <= 0:
        raise ValueError(f"forward_sleep_s must be > 0 or None, got {forward_sleep_s}")
    await _request("POST", f"{url}/slow_down", {"forward_sleep_time": forward_sleep_s})


@contextlib.asynccontextmanager
async def slowed_down(url: str, forward_sleep_s: float) -> AsyncIterator[None]:
    """:func:`set_forward_sleep` inside the block; full speed again on leaving it (also on error)."""
    await set_forward_sleep(url, forward_sleep_s)
    try:
        yield
    finally:
        await set_forward_sleep(url, None)


class StreamedGeneration:
    """One ``/generate`` request streamed from a real SGLang server, read in the background.

    Attributes:
        num_tokens: output tokens the server reported so far (its ``completion_tokens``).
        last: the last chunk received (``output_ids`` and ``meta_info`` of everything so far), or None.
    """

    def __init__(self, url: str, payload: dict[str, Any]):
        """Send ``payload`` (the body of a ``/generate`` request, ``stream`` is set here) to ``url``."""
        self.url = url
        self.num_tokens = 0
        self.last: dict[str, Any] | None = None
        self._progress = asyncio.Event()
        self._task = asyncio.ensure_future(self._read({**payload, "stream": True}))

    async def _read(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                async with session.post(f"{self.url}/generate", json=payload) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{self.url}/generate: HTTP {resp.status}: {(await resp.text())[:500]}")
                    while line := await resp.content.readline(max_line_length=_MAX_CHUNK_BYTES):
                        if line.startswith(b"data: {"):
                            self.last = json.loads(line[len(b"data: "):])
                            self.num_tokens = int(self.last["meta_info"]["completion_tokens"])
                            self._progress.set()
        finally:
            self._progress.set()  # wake a waiter: the stream ended (or failed)
        if self.last is None:
            raise RuntimeError(f"{self.url}/generate: the stream ended without a chunk")
        return self.last

    @property
    def finished(self) -> bool:
        """The server sent its last chunk (or the stream failed)."""
        return self._task.done()

    async def wait_tokens(self, num_tokens: int, *, timeout_s: float) -> None:
        """Wait until the server reports ``num_tokens`` output tokens for a request still running.

        Raises:
            TimeoutError: not reached within ``timeout_s`` seconds.
            AssertionError: the request finished first (it was never running with that many tokens).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._progress.clear()  # before the checks: asyncio runs nothing else in between
            if self.finished or (self.last is not None and self.last["meta_info"]["finish_reason"] is not None):
                await asyncio.wait_for(self._task, 60)  # raises the stream's own error, if any
                reason = self.last and self.last["meta_info"]["finish_reason"]
                raise AssertionError(f"the request finished with {self.num_tokens} tokens before it was seen "
                                     f"running with {num_tokens} ({reason})")
            if self.num_tokens >= num_tokens:
                return
            try:
                await asyncio.wait_for(self._progress.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise TimeoutError(f"{self.url}: {self.num_tokens} of {num_tokens} tokens "
                                   f"within {timeout_s} s") from None

    async def result(self) -> dict[str, Any]:
        """The last chunk: ``output_ids [N]`` (all of them) and ``meta_info`` with ``finish_reason``.

        Raises:
            RuntimeError: the server answered with an error or sent no chunk.
        """
        return await self._task

    async def cancel(self) -> None:
        """Stop reading (closing the stream; SGLang then aborts the request)."""
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
