#!/usr/bin/env python
"""Benchmark the retrieval service under concurrent agent load vs the library called in-process.

The workload is what rollouts send: C agent loops share one ``search`` tool and each issues one
call at a time until Q queries (one shared pool) are answered. For each concurrency C, in the same
run and one right after the other:

- ``in-process, C agents``: the C coroutines call ``Retriever.search([q], k)`` on an index loaded in
  this process, through ``asyncio.to_thread`` (how an in-process tool would call the library without
  blocking the agent loop's event loop). The Retriever's lock serialises the calls: no batching.
- ``service, C agents``: the C coroutines call megarl's ``SearchTool`` (one ``POST /retrieve`` per
  call over one shared aiohttp session, as the rollout manager shares one tool) against a
  ``RetrievalProcess`` bound to 127.0.0.1, which coalesces concurrent requests into batched
  library calls (``--max-wait-ms``, ``--max-batch-queries``).

Two reference rows, once: ``in-process, synchronous loop`` (the library's own latency per query, no
thread hop) and ``in-process, one batch`` (all Q queries in one call: the library's best case; its
latency is the whole call's).

Output (a markdown table, optionally JSON): queries/s, p50 and p99 latency per query (nearest rank)
of each row; per C the ratios service / in-process of queries/s and of p99; the service's mean
queries per library call; and how many service answers differ from the in-process answer to the same
query (formatted as the tool formats them; expected 0).

Bounded: each row answers exactly Q queries, each service row after C untimed warm-up requests (one
per agent, to open the connections); nothing listens beyond the loopback interface. The client
(this process) and the service share the machine's cores, as rollout workers and a co-located
service do.

Usage::

    python tools/benchmarks/retrieval.py --index DIR [--questions FILE] [--queries 2000]
        [--concurrency 1,16,64] [--top-k 3] [--max-wait-ms 2] [--json out.json]

``--questions``: a JSON-lines file with a ``query`` (or ``question``) field per line, cycled up to
``--queries``; default: six-word phrases drawn (seeded) from the index's ``passages.jsonl``.

Results (one run each; 2 CPU cores shared with other jobs, 1-min load average 8.2 for BM25, 3.9 to
3.2 for dense; ``--questions`` the Search-R1 example's 200 test questions; full tables, commands and
discussion in examples/search_r1/README.md, "Retrieval service throughput"). Service / in-process
at the same C, queries/s and p99; 0 answers differing in every row:

- BM25, 10,033 passages, 2,000 queries per row: C=1 0.13x qps, 16.0x p99; C=4 0.23x, 5.5x;
  C=16 0.67x, 0.92x; C=64 0.46x, 1.21x (a query costs ~0.3 ms; HTTP ~3 ms dominates).
- dense (faiss + all-MiniLM-L6-v2), 2,000 passages, 200 queries per row: C=1 0.82x, 1.07x;
  C=16 3.22x, 0.37x; C=64 3.93x, 0.40x (~7 ms of encoder per query; batching amortises it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from itertools import cycle, islice
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MAX_QUERIES = 100_000
MAX_CONCURRENCY = 1024


def make_queries(passages: Path, n: int, seed: int) -> list[str]:
    """``n`` six-word phrases from random passages of a JSON-lines file (``text`` field), seeded."""
    texts = [json.loads(line)["text"] for line in passages.open(encoding="utf-8") if line.strip()]
    long_texts = [t for t in texts if len(t.split()) >= 8]
    if not long_texts:
        raise ValueError(f"{passages}: no passage has 8 or more words to draw queries from")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words = rng.choice(long_texts).split()
        i = rng.randrange(0, len(words) - 6)
        out.append(" ".join(words[i:i + 6]))
    return out


def load_questions(path: Path, n: int) -> list[str]:
    """The ``query`` (else ``question``) field of each line of ``path``, cycled to ``n`` queries.

    Raises:
        ValueError: a line has neither field as a non-empty string, or the file has no lines.
    """
    queries = []
    for lineno, line in enumerate(path.open(encoding="utf-8"), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        q = row.get("query", row.get("question")) if isinstance(row, dict) else None
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{lineno}: needs a non-empty string field 'query' or 'question'")
        queries.append(q)
    if not queries:
        raise ValueError(f"{path}: no questions")
    return list(islice(cycle(queries), n))


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile: the ``ceil(p/100 * n)``-th smallest of ``n`` sorted values."""
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def stats(latencies_s: list[float], wall_s: float) -> dict[str, float]:
    """``qps`` (queries / wall seconds), ``p50_ms``, ``p99_ms`` (nearest rank), ``wall_s``."""
    lat = sorted(latencies_s)
    return {"qps": len(lat) / wall_s, "p50_ms": 1e3 * percentile(lat, 50),
            "p99_ms": 1e3 * percentile(lat, 99), "wall_s": wall_s}


def in_process_sync(retriever: Any, queries: list[str], top_k: int) -> dict[str, float]:
    """One ``search([q])`` after another in this thread."""
    lat = []
    start = time.perf_counter()
    for q in queries:
        t = time.perf_counter()
        retriever.search([q], top_k)
        lat.append(time.perf_counter() - t)
    return stats(lat, time.perf_counter() - start)


def in_process_batch(retriever: Any, queries: list[str], top_k: int) -> dict[str, float]:
    """All queries in one ``search`` call; every query's latency is the call's."""
    t = time.perf_counter()
    retriever.search(queries, top_k)
    wall = time.perf_counter() - t
    return stats([wall] * len(queries), wall)


async def in_process_agents(retriever: Any, queries: list[str], concurrency: int, top_k: int) -> dict[str, float]:
    """``concurrency`` coroutines draining ``queries``, each ``search([q])`` via ``asyncio.to_thread``."""
    todo = iter(queries)
    lat: list[float] = []

    async def agent() -> None:
        for q in todo:
            t = time.perf_counter()
            await asyncio.to_thread(retriever.search, [q], top_k)
            lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(concurrency)))
    return stats(lat, time.perf_counter() - start)


async def through_service(url: str, queries: list[str], concurrency: int, top_k: int,
                          expected: dict[str, str] | None = None) -> dict[str, float]:
    """``concurrency`` coroutines draining ``queries`` through one shared ``SearchTool``.

    Args:
        expected: query -> the observation the tool should return (differences are counted).

    Returns:
        :func:`stats` plus ``queries_per_call`` (the server's queries / library calls in this row)
        and ``mismatches``.

    Raises:
        RuntimeError: the tool answered ``Error: ...`` (service down, slow or refusing).
    """
    import aiohttp

    from megarl.rollout.tools.search import SearchTool

    tool = SearchTool(url=url, top_k=top_k, timeout_s=60)
    todo = iter(queries)
    lat: list[float] = []
    mismatches = 0

    async def call(q: str) -> str:
        obs = await tool({"query": q})
        if obs.startswith("Error:"):
            raise RuntimeError(f"search {q!r}: {obs}")
        return obs

    async def agent() -> None:
        nonlocal mismatches
        for q in todo:
            t = time.perf_counter()
            obs = await call(q)
            lat.append(time.perf_counter() - t)
            mismatches += expected is not None and obs != expected[q]

    async def counters() -> tuple[int, int]:
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            health = await resp.json()
        return health["num_batches"], health["num_queries"]

    try:
        await asyncio.gather(*(call(q) for q in queries[:concurrency]))  # open the connections
        batches0, queries0 = await counters()
        start = time.perf_counter()
        await asyncio.gather(*(agent() for _ in range(concurrency)))
        out = stats(lat, time.perf_counter() - start)
        batches1, queries1 = await counters()
    finally:
        await tool.close()
    out["queries_per_call"] = (queries1 - queries0) / max(1, batches1 - batches0)
    out["mismatches"] = mismatches
    return out


def expected_observations(retriever: Any, queries: list[str], top_k: int) -> dict[str, str]:
    """Query -> the ``search`` tool's observation of the in-process library's hits."""
    from megarl.rollout.tools.search import SearchTool, format_passages

    unique = list(dict.fromkeys(queries))
    chars = SearchTool().max_passage_chars
    return {q: format_passages([h.to_dict() for h in hits], chars)
            for q, hits in zip(unique, retriever.search(unique, top_k))}


def table(rows: dict[str, dict[str, float]], levels: list[int]) -> str:
    """Markdown table of the rows; service rows carry the ratios to the in-process row of their C."""
    lines = ["| workload | queries/s | p50 ms | p99 ms | qps service / in-process | "
             "p99 service / in-process | queries per library call | answers differing |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        extra = ["", "", "", ""]
        for c in levels:
            if name == f"service, {c} agents":
                base = rows[f"in-process, {c} agents"]
                extra = [f"{r['qps'] / base['qps']:.2f}", f"{r['p99_ms'] / base['p99_ms']:.2f}",
                         f"{r['queries_per_call']:.1f}", str(r["mismatches"])]
        lines.append(f"| {name} | {r['qps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     + " | ".join(extra) + " |")
    return "\n".join(lines)


def parse_levels(text: str, num_queries: int) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]``.

    Raises:
        ValueError: not comma-separated integers in ``[1, min(num_queries, MAX_CONCURRENCY)]``.
    """
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    top = min(num_queries, MAX_CONCURRENCY)
    if not levels or any(not 1 <= c <= top for c in levels):
        raise ValueError(f"--concurrency values must be in [1, {top}] (at most --queries), got {text!r}")
    return levels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True)
    p.add_argument("--questions", default=None, help="JSON lines with 'query' or 'question'")
    p.add_argument("--corpus", default=None, help="draw queries from this corpus (default: the index's)")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--max-batch-queries", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load_at_start = os.getloadavg()[0]
    if not 1 <= args.queries <= MAX_QUERIES:
        p.error(f"--queries must be in [1, {MAX_QUERIES}]")
    try:
        levels = parse_levels(args.concurrency, args.queries)
    except ValueError as e:
        p.error(str(e))
    # The service is `python -m megarl.retrieval.server`: let it import this checkout's megarl.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    from megarl.retrieval.index import Retriever
    from megarl.retrieval.service import RetrievalProcess

    index = Path(args.index)
    queries = (load_questions(Path(args.questions), args.queries) if args.questions else
               make_queries(Path(args.corpus) if args.corpus else index / "passages.jsonl",
                            args.queries, args.seed))
    retriever = Retriever(index)
    expected = expected_observations(retriever, queries, args.top_k)  # also the warm-up
    rows = {"in-process, synchronous loop": in_process_sync(retriever, queries, args.top_k),
            "in-process, one batch": in_process_batch(retriever, queries, args.top_k)}
    with RetrievalProcess(index, host="127.0.0.1", max_wait_ms=args.max_wait_ms,
                          max_batch_queries=args.max_batch_queries).start() as service:
        service.wait_ready(300)
        for c in levels:
            rows[f"in-process, {c} agents"] = asyncio.run(in_process_agents(retriever, queries, c, args.top_k))
            rows[f"service, {c} agents"] = asyncio.run(
                through_service(service.url, queries, c, args.top_k, expected))
    print(f"{retriever.backend} index {index} ({retriever.num_passages} passages), {len(queries)} "
          f"queries per row, top_k {args.top_k}, service max_wait_ms {args.max_wait_ms:g}, "
          f"max_batch_queries {args.max_batch_queries}, {os.cpu_count()} CPUs, 1-min load average "
          f"{load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end\n")
    print(table(rows, levels))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
