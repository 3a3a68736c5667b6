"""tools/benchmarks/retrieval.py measures what it says: every query answered exactly once per row,
nearest-rank percentiles, the server's batching as counted by the library, answer comparison, and
ratios against the in-process row of the same concurrency."""
import asyncio
import importlib.util
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from megarl.retrieval.index import Hit
from megarl.retrieval.server import build_app
from megarl.retrieval.service import free_port

pytestmark = pytest.mark.timeout(60)

_PATH = Path(__file__).resolve().parents[3] / "tools" / "benchmarks" / "retrieval.py"
_spec = importlib.util.spec_from_file_location("bench_retrieval", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class RecordingRetriever:
    """Answers ``q`` with one hit titled ``q``; records the queries of every library call."""

    manifest = {"backend": "bm25", "corpus_sha256": "0" * 64, "num_passages": 1}

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self._lock = threading.Lock()

    def search(self, queries, top_k):
        with self._lock:
            self.calls.append(list(queries))
        return [[Hit(id=q, title=q, text=f"text of {q}", score=1.0)] for q in queries]


@pytest.mark.parametrize("n", [1, 2, 7, 99, 100, 101, 250])
@pytest.mark.parametrize("p", [50, 99])
def test_percentile_is_numpys_inverted_cdf(n, p):
    values = sorted(random.Random(n).random() for _ in range(n))
    assert bench.percentile(values, p) == np.percentile(values, p, method="inverted_cdf")


def test_stats_qps_and_latencies():
    out = bench.stats([0.004, 0.001, 0.002, 0.003], wall_s=2.0)
    assert out == {"qps": 2.0, "p50_ms": 2.0, "p99_ms": 4.0, "wall_s": 2.0}


def test_load_questions_cycles_and_names_bad_lines(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"query": "a b"}\n\n{"question": "c d"}\n')
    assert bench.load_questions(path, 5) == ["a b", "c d", "a b", "c d", "a b"]
    path.write_text('{"query": "a"}\n{"answer": "x"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: .*'query' or 'question'"):
        bench.load_questions(path, 3)


def test_parse_levels_bounds():
    assert bench.parse_levels("1,16,64", 100) == [1, 16, 64]
    with pytest.raises(ValueError, match="--concurrency values must be in \\[1, 10\\]"):
        bench.parse_levels("1,11", 10)
    with pytest.raises(ValueError, match="--concurrency must be comma-separated integers"):
        bench.parse_levels("1,x", 10)


def test_in_process_agents_answer_each_query_once():
    retriever = RecordingRetriever()
    queries = [f"q{i}" for i in range(40)]
    out = asyncio.run(bench.in_process_agents(retriever, queries, 8, top_k=1))
    assert sorted(q for call in retriever.calls for q in call) == sorted(queries)
    assert all(len(call) == 1 for call in retriever.calls)
    assert out["qps"] == pytest.approx(40 / out["wall_s"])


async def _serve_and_run(retriever, queries, concurrency, expected, max_wait_ms=20.0):
    runner = web.AppRunner(build_app(retriever, max_batch_queries=64, max_wait_ms=max_wait_ms))
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await bench.through_service(f"http://127.0.0.1:{port}", queries, concurrency, 1, expected)
    finally:
        await runner.cleanup()


def test_through_service_counts_batches_and_mismatches():
    retriever = RecordingRetriever()
    queries = [f"q{i}" for i in range(60)]
    expected = bench.expected_observations(RecordingRetriever(), queries, 1)
    expected["q7"] = "something else"
    concurrency = 8
    out = asyncio.run(_serve_and_run(retriever, queries, concurrency, expected))
    # The first calls (summing to `concurrency` queries) are the untimed warm-up.
    warm, num_warm_calls = 0, 0
    while warm < concurrency:
        warm += len(retriever.calls[num_warm_calls])
        num_warm_calls += 1
    assert warm == concurrency
    timed = retriever.calls[num_warm_calls:]
    assert sorted(q for call in timed for q in call) == sorted(queries)
    assert out["queries_per_call"] == pytest.approx(len(queries) / len(timed))
    assert out["mismatches"] == 1
    assert out["qps"] == pytest.approx(len(queries) / out["wall_s"])


def test_through_service_raises_when_service_is_down():
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(RuntimeError, match="search service unavailable"):
        asyncio.run(bench.through_service(url, ["q"], 1, 1))


def test_table_ratios_use_the_same_concurrency():
    def row(qps, p99, **extra):
        return {"qps": qps, "p50_ms": 1.0, "p99_ms": p99, "wall_s": 1.0, **extra}

    rows = {"in-process, one batch": row(1000, 5.0),
            "in-process, 1 agents": row(100, 2.0),
            "service, 1 agents": row(50, 8.0, queries_per_call=1.0, mismatches=0),
            "in-process, 4 agents": row(80, 10.0),
            "service, 4 agents": row(120, 5.0, queries_per_call=3.5, mismatches=2)}
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")][4:]
             for line in bench.table(rows, [1, 4]).splitlines()[2:]}
    assert cells["service, 1 agents"] == ["0.50", "4.00", "1.0", "0"]
    assert cells["service, 4 agents"] == ["1.50", "0.50", "3.5", "2"]
    assert cells["in-process, 4 agents"] == ["", "", "", ""]
    assert cells["in-process, one batch"] == ["", "", "", ""]
