"""The retrieval service: one process serving an index over HTTP to every rollout worker.

    python -m megarl.retrieval.server --index DIR [--corpus FILE] [--backend bm25] --port P

API (JSON):

- ``POST /retrieve`` ``{"queries": [str, ...], "top_k": int}`` -> ``{"results": [[{"id",
  "title", "text", "score"}, ...], ...]}`` (one list per query, best first); a malformed request
  -> 400 ``{"error": "..."}``.
- ``GET /health`` -> ``{"status": "ok", "backend", "corpus_sha256", "num_passages"}``.

Concurrent requests are coalesced: the first waiting request opens a batch, which collects further
requests for up to ``--max-wait-ms`` or ``--max-batch-queries`` queries, and the whole batch is one
library call (``Retriever.search``) on a worker thread, so the event loop keeps accepting requests
while a batch runs. This is how many agent loops share one index (Search-R1's retrieval server
serves batches the same way).

At start the index is checked against the run config: ``--backend`` must be the index's backend and
``--corpus`` (hashed) or ``--corpus-sha256`` must be the corpus the index was built from; otherwise
the process exits with code 2 and says which.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megarl.retrieval.index import RetrievalIndexError, Retriever, read_manifest

log = logging.getLogger(__name__)

MAX_QUERY_CHARS = 2000
MAX_TOP_K = 100


class RequestError(ValueError):
    """A request the service cannot answer (400)."""


def check_index(index_dir: str, *, backend: str | None = None, corpus: str | None = None,
                corpus_sha256: str | None = None) -> dict[str, Any]:
    """The index's manifest, after checking it matches the config.

    Raises:
        RetrievalIndexError: not an index, another backend, or built from another corpus (the
            message names ``retrieval.backend`` / ``retrieval.corpus`` and both hashes).
    """
    from megarl.retrieval.corpus import corpus_sha256 as sha256_of

    manifest = read_manifest(index_dir)
    if backend and backend != manifest["backend"]:
        raise RetrievalIndexError(f"retrieval.backend is {backend!r} but index {index_dir} is "
                                  f"{manifest['backend']!r}")
    expected = corpus_sha256 or (sha256_of(corpus) if corpus else None)
    if expected and expected != manifest["corpus_sha256"]:
        raise RetrievalIndexError(
            f"retrieval.corpus: index {index_dir} was built from {manifest['corpus_name']} "
            f"(sha256 {manifest['corpus_sha256'][:12]}...), not from {corpus or 'the configured corpus'} "
            f"(sha256 {expected[:12]}...); rebuild it with `megarl index build`")
    return manifest


def parse_request(body: Any) -> tuple[list[str], int]:
    """``(queries, top_k)`` of a ``/retrieve`` body.

    Raises:
        RequestError: not ``{"queries": [str...], "top_k": int}`` within the limits.
    """
    if not isinstance(body, dict) or not isinstance(body.get("queries"), list):
        raise RequestError('body must be {"queries": [str, ...], "top_k": int}')
    queries = body["queries"]
    if not all(isinstance(q, str) for q in queries):
        raise RequestError("queries must be strings")
    if any(len(q) > MAX_QUERY_CHARS for q in queries):
        raise RequestError(f"a query is longer than {MAX_QUERY_CHARS} characters")
    top_k = body.get("top_k", 3)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be an integer in [1, {MAX_TOP_K}]")
    return queries, top_k


@dataclass
class _Pending:
    queries: list[str]
    top_k: int
    future: asyncio.Future = field(repr=False)


class Batcher:
    """Coalesces concurrent requests into batched ``Retriever.search`` calls (one at a time).

    Args:
        retriever: the index.
        max_batch_queries: most queries in one library call.
        max_wait_ms: how long an open batch waits for more requests.
    """

    def __init__(self, retriever: Retriever, *, max_batch_queries: int = 64, max_wait_ms: float = 2.0):
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.max_wait_s = max_wait_ms / 1000
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="retrieve")
        self._task: asyncio.Task | None = None
        self.num_batches = 0
        self.num_queries = 0

    def start(self) -> None:
        """Start the batching task on the running event loop (call once, from the server's start-up)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Cancel the batching task and the worker thread's queued searches."""
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def search(self, queries: list[str], top_k: int) -> list[list[dict[str, Any]]]:
        """The ``top_k`` hits of each query (``[len(queries)][top_k]`` hit dicts, best first), searched
        in one library call together with the other requests that arrive within ``max_wait_ms``.

        Raises:
            Exception: what the retriever's search raised (every request of that batch gets it).
        """
        if not queries:
            return []
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, top_k, future))
        return await future

    async def _collect(self) -> list[_Pending]:
        batch = [await self._queue.get()]
        size = len(batch[0].queries)
        deadline = time.monotonic() + self.max_wait_s
        while size < self.max_batch_queries:
            try:
                item = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
            batch.append(item)
            size += len(item.queries)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            queries = [q for p in batch for q in p.queries]
            top_k = max(p.top_k for p in batch)
            try:
                hits = await loop.run_in_executor(self._executor, self.retriever.search, queries, top_k)
            except Exception as e:  # noqa: BLE001 - reported to every request of the batch
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self.num_batches += 1
            self.num_queries += len(queries)
            start = 0
            for p in batch:
                rows = hits[start:start + len(p.queries)]
                start += len(p.queries)
                if not p.future.done():
                    p.future.set_result([[h.to_dict() for h in row[:p.top_k]] for row in rows])


def build_app(retriever: Retriever, *, max_batch_queries: int = 64, max_wait_ms: float = 2.0) -> web.Application:
    """The aiohttp application serving ``retriever``."""
    batcher = Batcher(retriever, max_batch_queries=max_batch_queries, max_wait_ms=max_wait_ms)
    manifest = retriever.manifest

    async def retrieve(request: web.Request) -> web.Response:
        try:
            queries, top_k = parse_request(await request.json())
        except (RequestError, ValueError) as e:  # JSONDecodeError is a ValueError
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"results": await batcher.search(queries, top_k)})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "backend": manifest["backend"],
                                  "corpus_sha256": manifest["corpus_sha256"],
                                  "num_passages": manifest["num_passages"],
                                  "num_batches": batcher.num_batches, "num_queries": batcher.num_queries})

    async def on_startup(app: web.Application) -> None:
        batcher.start()

    async def on_cleanup(app: web.Application) -> None:
        await batcher.stop()

    app = web.Application(client_max_size=16 << 20)
    app.add_routes([web.post("/retrieve", retrieve), web.get("/health", health)])
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def main(argv: list[str] | None = None) -> int:
    """``python -m megarl.retrieval.server --index DIR --port N``: check the index (backend, corpus)
    and serve it over HTTP until killed. Returns 2 with one line on stderr when the index is missing
    or was built from another corpus or backend, else 0 after the server stops.
    """
    p = argparse.ArgumentParser(prog="python -m megarl.retrieval.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="index directory (megarl index build)")
    p.add_argument("--backend", default=None, help="refuse an index of another backend")
    p.add_argument("--corpus", default=None, help="refuse an index built from another corpus file")
    p.add_argument("--corpus-sha256", default=None, help="same, by the corpus file's SHA-256")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch-queries", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_index(args.index, backend=args.backend, corpus=args.corpus, corpus_sha256=args.corpus_sha256)
    except (RetrievalIndexError, FileNotFoundError) as e:
        print(f"megarl retrieval: {e}", file=sys.stderr)
        return 2
    retriever = Retriever(args.index)
    log.info("serving %s index %s (%d passages) on http://%s:%d", retriever.backend, args.index,
             retriever.num_passages, args.host, args.port)
    web.run_app(build_app(retriever, max_batch_queries=args.max_batch_queries,
                          max_wait_ms=args.max_wait_ms),
                host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
