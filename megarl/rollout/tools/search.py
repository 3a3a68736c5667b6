"""The ``search`` tool: ask the retrieval service (:mod:`megarl.retrieval.server`) for passages.

``{"query": str}`` -> the top-k passages as one observation, Search-R1's layout::

    Doc 1 (Title: Paris) Paris is the capital and largest city of France...
    Doc 2 (Title: ...) ...

The agent loop appends the observation with ``loss_mask`` 0 (retrieved text is never trained on).
Nothing here raises into the agent loop: a service that is down, slow or answering an error becomes
an ``Error: ...`` observation (counted by the loop as a tool error, and here in
``search/service_errors_sum``); an empty or over-long query is an ``Error: ...`` observation too.

Rollout metrics (:meth:`SearchTool.drain_metrics`, added to each step's ``rollout`` metrics):
``search/queries_sum``, ``search/service_errors_sum``, ``search/latency_s_mean``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from megarl.rollout.tools.tool_registry import register_tool

MAX_QUERY_CHARS = 500


def format_passages(hits: list[dict[str, Any]], max_passage_chars: int) -> str:
    """Search-R1's observation text of one query's hits (``No results.`` when there are none)."""
    if not hits:
        return "No results."
    lines = []
    for i, hit in enumerate(hits, 1):
        text = str(hit.get("text", ""))
        if len(text) > max_passage_chars:
            text = text[:max_passage_chars] + "..."
        lines.append(f"Doc {i} (Title: {hit.get('title', '')}) {text}")
    return "\n".join(lines)


@register_tool("search")
class SearchTool:
    """``{"query": str}`` -> passages from the retrieval service, or ``Error: ...``.

    Args:
        url: the service's base URL (``http://host:port``); the launcher fills it in when it starts
            the service (``retrieval`` section) and the YAML leaves it empty.
        top_k: passages per query.
        timeout_s: limit of one HTTP request (a slow service -> error observation).
        max_passage_chars: each passage's text is cut to this length.
        retries: extra attempts after a connection failure (not after a timeout).

    Raises:
        ValueError: ``top_k`` < 1 or ``timeout_s`` <= 0.
    """

    name = "search"

    def __init__(self, *, url: str = "", top_k: int = 3, timeout_s: float = 10.0,
                 max_passage_chars: int = 600, retries: int = 1) -> None:
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if float(timeout_s) <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = str(url).rstrip("/")
        self.top_k = int(top_k)
        self.timeout_s = float(timeout_s)
        self.max_passage_chars = int(max_passage_chars)
        self.retries = int(retries)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._queries = 0
        self._errors = 0
        self._latency_s: list[float] = []
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Search an encyclopedia; returns the most relevant passages.",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "search terms"}},
                    "required": ["query"],
                },
            },
        }

    def _client(self) -> aiohttp.ClientSession:
        # One session per event loop (the tool may be built outside the loop that calls it).
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._session_loop = loop
        return self._session

    async def search(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        """Hits of each query from the service.

        Raises:
            RuntimeError: no ``url``; aiohttp.ClientError / asyncio.TimeoutError: service failures.
        """
        if not self.url:
            raise RuntimeError("search tool has no url (start the retrieval service or set "
                               "rollout.tools.search.url)")
        body = {"queries": queries, "top_k": self.top_k}
        for attempt in range(self.retries + 1):
            try:
                async with self._client().post(self.url + "/retrieve", json=body) as resp:
                    payload = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RuntimeError(f"service answered {resp.status}: {payload.get('error')}")
                    return payload["results"]
            except aiohttp.ClientConnectionError:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))
        raise AssertionError("unreachable")

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Passages for ``arguments["query"]``; failures are returned as ``Error: ...`` text."""
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return "Error: query must be a non-empty string"
        if len(query) > MAX_QUERY_CHARS:
            return f"Error: query longer than {MAX_QUERY_CHARS} characters"
        self._queries += 1
        start = time.monotonic()
        try:
            hits = (await self.search([query.strip()]))[0]
        except TimeoutError:
            self._errors += 1
            return f"Error: search service did not answer within {self.timeout_s:g} s"
        except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as e:
            self._errors += 1
            return f"Error: search service unavailable ({type(e).__name__}: {e})"
        self._latency_s.append(time.monotonic() - start)
        return format_passages(hits, self.max_passage_chars)

    def drain_metrics(self) -> dict[str, float]:
        """Counters since the last call (then reset): ``search/*`` metrics of one rollout step."""
        out = {"search/queries_sum": float(self._queries), "search/service_errors_sum": float(self._errors),
               "search/latency_s_mean": (sum(self._latency_s) / len(self._latency_s)
                                         if self._latency_s else 0.0)}
        self._queries, self._errors, self._latency_s = 0, 0, []
        return out

    async def close(self) -> None:
        """Close the HTTP session to the retrieval service."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
