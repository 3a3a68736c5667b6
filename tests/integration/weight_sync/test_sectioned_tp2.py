"""Qwen3.5-MoE's gated DeltaNet synced into a real SGLang CPU server at engine TP 2, pre-sharded.

SGLang holds the DeltaNet's ``in_proj_qkv`` / ``conv1d`` rows section by section (rank ``r``:
``[q_r; k_r; v_r]``) and ``dt_bias`` / ``A_log`` by head; each engine rank receives exactly those row
blocks (``p2p`` from every trainer rank or from a segment's assembler, ``shard`` over shared memory),
and its loader puts them back at their rows for SGLang's own narrowing loaders. The whole-tensor
path (``distributed``) is synced too. Trainer: Megatron-Core at TP2 x EP2 (expert TP 1), two steps
with a large learning rate. References: the trainer's own logprobs of the probes (after the first sync,
``p2p`` from every trainer rank, the engine answers as the trainer within fp32 noise: a section block
in the wrong place, or a rank loading the other's blocks, moves them by far more); SGLang's own
whole-tensor loading of the same weights (``distributed``) for the later pre-sharded paths; and the
engine's load proof (every received slice found bit for bit in a parameter of its module, every sync).

Open (2026-11-28): each path starts from a reload from disk; after the first, every path, SGLang's own
``distributed`` included, answers ~0.011 (mean |logprob gap|) away from the trainer, the same for all
three, while the first sync is exact (2e-7): engine state across a reload + sync at TP 2, not the slicing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import sectioned_workers
from test_weight_sync_engine import gap, probes, train_sequences

TOLERANCE = 1e-3
"""Mean |engine - trainer| logprob, as ``test_load_proof.py``."""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_qwen3_5_deltanet_sections_reach_each_engine_rank_of_a_tp2_engine(tiny_qwen3_5_moe_dir, tmp_path):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    engine = EngineProcess(tiny_qwen3_5_moe_dir, tp_size=2, device="cpu", dtype="float32", mem_fraction_static=0.15,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1"}, log_path=tmp_path / "engine.log", engine_id="sectioned_tp2")
    engine.start()
    try:
        engine.wait_healthy(600)
        out = run_ranks(sectioned_workers.sync_every_path, 2, timeout_s=1080, args=(
            str(tiny_qwen3_5_moe_dir), [engine.url], probes(), train_sequences()))[0]
    finally:
        engine.stop(grace_s=0)
    gaps = {path: gap(got["engine"], out["trainer"]) for path, got in out["paths"].items()}
    print("\nengine TP2 vs trainer TP2xEP2 after each sync, (mean, max) |logprob gap|:", gaps)
    for path, got in out["paths"].items():
        assert got["error"] is None, (path, got["error"])  # every bucket loaded, the load proof passed
        if path.startswith("p2p/"):  # each engine rank received its own slices, counted inside the server
            for rank in (0, 1):
                assert got["metrics"][f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)
    assert gaps["p2p/owner"][0] <= TOLERANCE, gaps  # the first sync after the engine's start: = the trainer
    # The later paths (each after a reload from disk and a sync before it) all answer as SGLang's own
    # whole-tensor loading of the same weights (distributed), which differs from the trainer by ~0.011
    # (open, not megarl's slicing: seen 2026-11-28 with SGLang's own loader too); pre-sharded = SGLang's own:
    reference = out["paths"]["distributed/segment"]["engine"]
    for path in ("p2p/segment", "shard/segment"):
        assert gap(out["paths"][path]["engine"], reference)[1] < 1e-5, (path, gap(out["paths"][path]["engine"],
                                                                                   reference))
