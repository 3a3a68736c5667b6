"""The retrieval service process and the ``search`` tool: results equal the in-process library,
concurrent queries are coalesced, and failures become observations, never exceptions."""
import asyncio
import json
import socket

import aiohttp
import pytest

from megarl.retrieval.index import Retriever, build_index
from megarl.retrieval.service import RetrievalProcess, RetrievalStartupError
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.search import format_passages

pytestmark = pytest.mark.timeout(120)

TOPICS = ["volcano lava eruption", "glacier ice flow", "desert dunes wind", "river delta sediment",
          "forest canopy trees", "ocean tides moon", "mountain summit snow", "island coral reef"]


@pytest.fixture(scope="module")
def corpus_and_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    corpus = root / "corpus.jsonl"
    rows = [{"id": str(i), "title": t.split()[0].title(), "text": f"The {t} passage number {i}."}
            for i, t in enumerate(TOPICS)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_index(corpus, root / "idx", progress=False)
    return corpus, root / "idx"


@pytest.fixture(scope="module")
def service(corpus_and_index):
    corpus, index = corpus_and_index
    proc = RetrievalProcess(index, backend="bm25", corpus=str(corpus), max_wait_ms=200).start()
    try:
        yield proc.wait_ready(timeout_s=60)
    finally:
        proc.stop()


async def test_search_tool_through_the_service_matches_the_library(service, corpus_and_index):
    tool = build_tools({"search": {"url": service.url, "top_k": 2}})["search"]
    queries = [t.split()[1] for t in TOPICS]  # "lava", "ice", ...
    before = service.health()["num_batches"]
    observations = await asyncio.gather(*(tool({"query": q}) for q in queries))
    expected = Retriever(corpus_and_index[1]).search(queries, top_k=2)
    for obs, hits in zip(observations, expected):
        assert obs == format_passages([h.to_dict() for h in hits], tool.max_passage_chars)
    assert observations[0].startswith("Doc 1 (Title: Volcano) The volcano lava eruption")
    health = service.health()
    assert health["num_batches"] - before < len(queries)  # concurrent requests were coalesced
    metrics = tool.drain_metrics()
    assert metrics["search/queries_sum"] == 8 and metrics["search/service_errors_sum"] == 0
    assert tool.drain_metrics()["search/queries_sum"] == 0
    await tool.close()


async def test_malformed_queries_are_observations(service):
    tool = build_tools({"search": {"url": service.url}})["search"]
    assert (await tool({"query": "   "})).startswith("Error: query must be a non-empty string")
    assert (await tool({"query": "x" * 501})).startswith("Error: query longer than 500")
    assert await tool({"query": "zzzz qqqq"}) == "No results."
    async with aiohttp.ClientSession() as s:
        async with s.post(service.url + "/retrieve", json={"queries": "lava"}) as resp:
            assert resp.status == 400 and "queries" in (await resp.json())["error"]
    await tool.close()


async def test_service_down_or_slow_is_an_error_observation_and_a_metric():
    with socket.socket() as silent:  # accepts connections, never answers: a hung service
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        slow = build_tools({"search": {"url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                       "timeout_s": 0.5}})["search"]
        assert await slow({"query": "lava"}) == "Error: search service did not answer within 0.5 s"
        await slow.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    down = build_tools({"search": {"url": f"http://127.0.0.1:{closed_port}", "retries": 1}})["search"]
    assert (await down({"query": "lava"})).startswith("Error: search service unavailable (ClientConnector")
    assert down.drain_metrics()["search/service_errors_sum"] == 1
    await down.close()


def test_service_refuses_an_index_of_another_corpus(corpus_and_index, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "0", "text": "something else"}\n')
    proc = RetrievalProcess(corpus_and_index[1], corpus=str(other)).start()
    with pytest.raises(RetrievalStartupError, match="exited with code 2.*retrieval.corpus: index"):
        proc.wait_ready(timeout_s=60)


@pytest.mark.slow  # Ray start-up: 18 s on a quiet machine, 38 s under load
def test_launcher_starts_the_service_as_a_ray_actor_and_refuses_another_corpus(corpus_and_index, tmp_path, monkeypatch):
    from pathlib import Path

    import ray

    from megarl.cluster.retrieval import start_retrieval, stop_retrieval
    from megarl.config import load_config

    corpus, index = corpus_and_index
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "0", "text": "something else"}\n')
    base = Path(__file__).resolve().parents[3] / "configs" / "base.yaml"
    cfg = load_config(base, ["rollout.tools.search={}", f"retrieval.index={index}",
                             f"retrieval.corpus={corpus}"])
    from ray._private import ray_constants

    from megarl.cluster.placement import LOCAL_RAY_LOOPBACK_ENV
    from megarl.testing.local_ray import one_auth_mode

    monkeypatch.setenv(LOCAL_RAY_LOOPBACK_ENV, "0")  # a single-host Ray on 127.0.0.1 (megarl.cluster.placement)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    one_auth_mode()  # as the run's own start (init_ray): one mode for the whole pytest process
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = start_retrieval(cfg, tmp_path)
        try:
            tool = build_tools(dict(cfg.rollout.tools))["search"]
            assert asyncio.run(tool({"query": "lava"})).startswith("Doc 1 (Title: Volcano)")
        finally:
            stop_retrieval(actor)
        assert (tmp_path / "retrieval.log").exists()
        bad = load_config(base, ["rollout.tools.search={}", f"retrieval.index={index}",
                                 f"retrieval.corpus={other}"])
        with pytest.raises(RetrievalStartupError, match="retrieval.corpus: index"):
            start_retrieval(bad, tmp_path)
    finally:
        ray.shutdown()


def test_service_dies_with_its_owner(corpus_and_index):
    """A killed driver or Ray actor must not leave the service serving (it did before PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time\nfrom megarl.retrieval.service import RetrievalProcess\n"
            "p = RetrievalProcess(sys.argv[1]).start().wait_ready(60)\nprint(p._proc.pid, flush=True)\n"
            "time.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", code, str(corpus_and_index[1])], stdout=subprocess.PIPE, text=True)
    service_pid = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(service_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(service_pid, signal.SIGKILL)
    pytest.fail("the retrieval service outlived its owner")
