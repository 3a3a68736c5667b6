"""The engine proves what it loaded (issue 34 part 2), on a real SGLang CPU server of the tiny
DeepSeek-V3 (MLA with ``q_lora_rank``), every tensor in its own bucket.

References: the trainer's own logprobs after the sync (engine = trainer within fp32 noise when the
groups are kept whole); SGLang's own DeepSeek loader, which drops a ``q_a_proj`` /
``kv_a_proj_with_mqa`` that arrives without its partner: with the groups ignored (the plan before
issue 34) the sync must fail naming one of them, where before it answered success.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import load_proof_workers  # noqa: E402
from test_weight_sync_engine import gap, probes, train_sequences  # noqa: E402

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def deepseek_engine(tiny_deepseek_v3_dir, tmp_path_factory):
    from megarl.rollout.engine import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    engine = EngineProcess(tiny_deepseek_v3_dir, tp_size=1, device="cpu", dtype="float32", mem_fraction_static=0.15,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1"}, log_path=tmp_path_factory.mktemp("logs") / "ds_engine.log",
                           engine_id="ds_engine")
    engine.start()
    try:
        engine.wait_healthy(300)
        yield engine
    finally:
        engine.stop(grace_s=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_split_mla_pair_is_named_and_whole_pair_loads(deepseek_engine, tiny_deepseek_v3_dir):
    out = run_ranks(load_proof_workers.sync_with_and_without_groups, 1, timeout_s=840, args=(
        str(tiny_deepseek_v3_dir), [deepseek_engine.url], probes(), train_sequences(), 0.001))[0]
    mean, peak = gap(out["engine"], out["trainer"])
    assert mean <= TOLERANCE, (mean, peak)
    assert out["split_pairs"] == 2  # both layers' q_a_proj / kv_a_proj_with_mqa in different buckets
    error = out["error"]
    assert error is not None and "none of the engine's parameters" in error, error
    assert "q_a_proj" in error or "kv_a_proj_with_mqa" in error, error
    assert "engine 0" in error and "rank 0" in error, error
    print(f"\nload proof: engine vs trainer after the grouped sync {mean:.2e}; split sync: {error[:400]}")
