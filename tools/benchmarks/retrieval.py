#!/usr/bin/env python
"""Benchmark the retrieval service under concurrent load vs the library called in-process.

The workload is what rollouts send: C agent loops, each issuing one ``search`` call at a time
(megarl's ``search`` tool: one HTTP request per call) until Q queries are answered. Compared with:

- ``in-process, one at a time``: ``Retriever.search([q], k)`` called per query in this process
  (what each rollout worker would do without a service: no sharing, no batching);
- ``in-process, one batch``: all Q queries in one ``Retriever.search`` call (the library's best case).

Output (a markdown table and JSON): queries/s, p50 and p99 latency per query for each, and the
ratio service qps / in-process-one-at-a-time qps at each concurrency. Queries are six-word phrases
drawn from the corpus itself (seeded).

Usage::

    python tools/benchmarks/retrieval.py --index DIR [--corpus FILE] [--queries 2000]
        [--concurrency 1,16,64] [--top-k 3] [--json out.json]

``--corpus`` defaults to the index's own ``passages.jsonl``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path


def make_queries(passages: Path, n: int, seed: int) -> list[str]:
    texts = [json.loads(line)["text"] for line in passages.open(encoding="utf-8") if line.strip()]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words = rng.choice(texts).split()
        if len(words) >= 8:
            i = rng.randrange(0, len(words) - 6)
            out.append(" ".join(words[i:i + 6]))
    return out


def stats(latencies_s: list[float], wall_s: float) -> dict[str, float]:
    lat = sorted(latencies_s)
    return {"qps": len(lat) / wall_s, "p50_ms": 1e3 * statistics.median(lat),
            "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "wall_s": wall_s}


def in_process(retriever, queries: list[str], top_k: int) -> tuple[dict, dict]:
    lat = []
    start = time.perf_counter()
    for q in queries:
        t = time.perf_counter()
        retriever.search([q], top_k)
        lat.append(time.perf_counter() - t)
    single = stats(lat, time.perf_counter() - start)
    t = time.perf_counter()
    retriever.search(queries, top_k)
    wall = time.perf_counter() - t
    return single, {"qps": len(queries) / wall, "p50_ms": 1e3 * wall, "p99_ms": 1e3 * wall, "wall_s": wall}


async def through_service(url: str, queries: list[str], concurrency: int, top_k: int) -> dict:
    from megarl.rollout.tools.search import SearchTool

    tool = SearchTool(url=url, top_k=top_k, timeout_s=60)
    todo = iter(queries)
    lat: list[float] = []

    async def agent() -> None:
        for q in todo:
            t = time.perf_counter()
            obs = await tool({"query": q})
            lat.append(time.perf_counter() - t)
            if obs.startswith("Error:"):
                raise RuntimeError(obs)

    await tool({"query": queries[0]})  # connect once
    start = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(concurrency)))
    out = stats(lat, time.perf_counter() - start)
    await tool.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True)
    p.add_argument("--corpus", default=None)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from megarl.retrieval.index import Retriever
    from megarl.retrieval.service import RetrievalProcess

    index = Path(args.index)
    queries = make_queries(Path(args.corpus) if args.corpus else index / "passages.jsonl", args.queries, args.seed)
    retriever = Retriever(index)
    retriever.search(queries[:8], args.top_k)  # warm-up
    single, batch = in_process(retriever, queries, args.top_k)
    rows = {"in-process, one at a time": single, "in-process, one batch": batch}
    with RetrievalProcess(index, max_wait_ms=args.max_wait_ms).start() as service:
        service.wait_ready(300)
        for c in (int(x) for x in args.concurrency.split(",")):
            rows[f"service, {c} concurrent agents"] = asyncio.run(
                through_service(service.url, queries, c, args.top_k))
    base = single["qps"]
    print(f"{retriever.backend} index {index} ({retriever.num_passages} passages), {len(queries)} queries, "
          f"top_k {args.top_k}\n")
    print("| workload | queries/s | p50 ms | p99 ms | qps / in-process one-at-a-time |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['qps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['qps'] / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
