"""One SGLang CPU server at TP=2 for the weight-sync tests of this folder (~50 s to start on 2 cores).

Its shard loader reports the bytes each rank receives (one JSON line per load and rank under the
stats directory). Each test gets it as it was started: the model's own weights reloaded from disk
and the loader's reports cleared, whatever the test before pushed.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def _tp2_engine_started(tiny_moe_dir, tmp_path_factory):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS, STATS_DIR_ENV

    stats = tmp_path_factory.mktemp("loader_stats")
    engine = EngineProcess(tiny_moe_dir, tp_size=2, device="cpu", dtype="float32", mem_fraction_static=0.15,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1", STATS_DIR_ENV: str(stats)},
                           log_path=tmp_path_factory.mktemp("logs") / "tp2_engine.log", engine_id="tp2_engine")
    engine.start()
    try:
        engine.wait_healthy(300)
        yield engine, stats
    finally:
        engine.stop(grace_s=0)


async def _reload_from_disk(url: str, model_dir: Path) -> None:
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(url, request_timeout_s=300) as client:
        await client.update_weights_from_disk(str(model_dir))


@pytest.fixture
def tp2_engine(_tp2_engine_started, tiny_moe_dir):
    """``(engine, stats_dir)``: the shared TP=2 server holding ``tiny_moe_dir``'s weights, no reports."""
    engine, stats = _tp2_engine_started
    asyncio.run(_reload_from_disk(engine.url, tiny_moe_dir))
    for report in Path(stats).glob("*.jsonl"):
        report.unlink()
    return engine, stats
