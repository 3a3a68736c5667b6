"""The CPU seeding shim: a real SGLang server samples the same tokens for the same ``sampling_seed``,
whatever else is in the batch, and different tokens for different seeds."""
from __future__ import annotations

import asyncio
import os

import pytest

from megarl.cluster.ray_engines import SEEDING_SHIM_DIR


@pytest.fixture(scope="module")
def seeded_server(tiny_moe_dir, tmp_path_factory):
    from megarl.rollout.engine_process import EngineProcess

    env = dict(os.environ, MEGARL_SEEDED_SAMPLING="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
                                         str(SEEDING_SHIM_DIR)])
    old = dict(os.environ)
    os.environ.update(env)  # the launcher builds the server environment from ours (then adds its shims)
    try:
        engine = EngineProcess(tiny_moe_dir, device="cpu", dtype="float32", max_total_tokens=8192,
                               mem_fraction_static=0.05, log_path=tmp_path_factory.mktemp("seeded") / "engine.log")
        engine.start()
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        engine.wait_healthy(300)
        yield engine
    finally:
        engine.stop()


async def _generate(url, requests):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(url) as client:
        outs = await asyncio.gather(*(client.generate(ids, params) for ids, params in requests))
    return [o.output_ids for o in outs]


@pytest.mark.timeout(420)
def test_same_seed_same_tokens_in_any_batch(seeded_server):
    prompt = list(range(5, 25))
    params = lambda seed: {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": seed}  # noqa: E731
    alone = asyncio.run(_generate(seeded_server.url, [(prompt, params(11))]))[0]
    # The same request again, now batched with others (other seeds, other prompts).
    batch = asyncio.run(_generate(seeded_server.url, [(list(range(30, 44)), params(5)), (prompt, params(11)),
                                                      (prompt, params(12)), (prompt, params(13))]))
    assert batch[1] == alone
    assert len({tuple(b) for b in batch[1:]}) == 3  # other seeds sample other continuations
    assert "megarl seeded sampling" not in seeded_server.log_tail()  # the patch found its target
