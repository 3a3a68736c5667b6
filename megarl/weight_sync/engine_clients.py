"""Synchronous access to a set of SGLang engines for weight-sync code running on trainer ranks.

Trainer ranks are plain blocking programs (torch.distributed calls); the rollout client
(:class:`megarl.rollout.client.SGLangClient`) is async. :class:`EngineClients` runs the clients on a
private event loop in a background thread and exposes blocking calls over all engines at once
(``call_all``) and non-blocking ones (``submit_all``) that return ``concurrent.futures.Future`` —
the weight-update requests must be in flight while this thread joins a collective with the engines.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any


class EngineClients:
    """All engines that receive weight updates (one :class:`SGLangClient` per server).

    Args:
        urls: ``http://host:port`` of each engine.
        request_timeout_s: timeout of one control / update request.
    """

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 600.0) -> None:
        from megarl.rollout.client import SGLangClient

        if not urls:
            raise ValueError("EngineClients needs at least one engine URL")
        self.urls = list(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self.clients = [SGLangClient(u, request_timeout_s=request_timeout_s, max_connect_retries=2)
                        for u in self.urls]

    def __len__(self) -> int:
        return len(self.clients)

    def submit(self, index: int, method: str, *args, **kwargs) -> concurrent.futures.Future:
        """Start ``clients[index].method(*args, **kwargs)``; returns at once."""
        coro = getattr(self.clients[index], method)(*args, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit_all(self, method: str, *args, **kwargs) -> list[concurrent.futures.Future]:
        """Start the same call on every engine; returns the futures at once."""
        return [self.submit(i, method, *args, **kwargs) for i in range(len(self.clients))]

    def call_all(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Run the same call on every engine concurrently and wait for all (first error re-raised)."""
        return wait_all(self.submit_all(method, *args, **kwargs), timeout_s)

    def close(self) -> None:
        """Close the HTTP sessions and stop the background loop (idempotent)."""
        if not self._loop.is_running():
            return
        for client in self.clients:
            asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> EngineClients:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_all(futures: Sequence[concurrent.futures.Future], timeout_s: float | None = None) -> list[Any]:
    """Results of all futures, in order; waits for every one before re-raising the first error."""
    concurrent.futures.wait(futures, timeout=timeout_s)
    results: list[Any] = []
    error: BaseException | None = None
    for fut in futures:
        if not fut.done():
            error = error or TimeoutError(f"engine request not answered within {timeout_s} s")
            results.append(None)
            continue
        exc = fut.exception()
        error = error or exc
        results.append(None if exc else fut.result())
    if error is not None:
        raise error
    return results
