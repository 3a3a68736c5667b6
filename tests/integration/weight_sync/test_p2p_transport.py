"""The ``p2p`` transport (shard-to-shard over a process group) into a real SGLang CPU server at TP=2.

References: the same trainer weights loaded from disk by the engine (``/update_weights_from_disk``);
the bytes each engine rank received as counted by the receiver inside the server vs its shard from
the plan; a corrupted bucket must be refused by name and leave the engine's weights untouched.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import p2p_workers
from test_weight_sync_engine import gap, probes, train_sequences


@pytest.mark.slow
@pytest.mark.ci  # the p2p weight-sync path
@pytest.mark.timeout(600)
def test_p2p_delivers_each_ranks_shard_checks_it_and_refuses_a_flipped_byte(tp2_engine, tiny_moe_dir, tmp_path):
    out = run_ranks(p2p_workers.sync_then_corrupt, 2, timeout_s=540, args=(
        str(tiny_moe_dir), "tp2", [tp2_engine[0].url], probes(), 2, str(tmp_path), train_sequences(), (0, 1)))[0]
    # engine outputs after the p2p sync == after loading the same weights from disk (to float rounding:
    # SGLang's CPU loading of full vs pre-sharded experts sums in another order)
    assert gap(out["p2p"][0], out["disk"][0])[1] < 1e-5
    metrics = out["metrics"]["p2p"]
    for rank in (0, 1):  # counted by the receiver inside the server, over its shard from the plan
        assert metrics[f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)
    # the flipped byte in bucket 0 for engine rank 1 is named (bucket, rank, tensor) ...
    assert out["error"] is not None and "checksum mismatch" in out["error"] and "rank 1" in out["error"]
    assert "bucket 0" in out["error"] and out["tensor_names"][0] in out["error"], out["error"]
    # ... and no rank loaded anything: the engine answers exactly as after the good sync
    assert out["after_corrupt"] == out["p2p"]
    print(f"\np2p TP2 engine: {out['error'][:300]}")
    # the sender failing mid-bucket: its own error on every rank, nothing loaded (rank 0's real
    # bytes of that bucket were voted down by the sender), and the same group carries the next sync
    # (trainer TP2 -> engine TP2: trainer rank 1 sends engine rank 1's segment, so it is the one that
    # failed; the stage sender's error names it)
    errors = out["abort_errors"]
    assert all(e is not None for e in errors) and "injected sender failure" in errors[1], errors
    assert "trainer rank 1" in errors[0] and "stopped mid-stage" in errors[0], errors[0]
    assert "checksum" not in errors[0], errors[0]  # the zeros that released engine rank 1 are not a second error
    assert out["after_abort"] == out["p2p"]
    assert gap(out["p2p_after"][0], out["disk_after"][0])[1] < 1e-5
    assert out["p2p_after"] != out["p2p"]  # the trainer moved on: the last sync delivered new weights
    after = out["metrics_after_abort"]
    for rank in (0, 1):
        assert after[f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.ci  # the p2p weight-sync path
@pytest.mark.timeout(900)
def test_p2p_from_tp2_pp2_sends_from_every_tp_rank_of_both_stages(tp2_engine, tiny_moe_dir, tmp_path):
    """Four trainer ranks (TP2 x PP2) into the TP2 engine: each stage has two senders (its TP rank
    k sends engine rank k's segments, ``SegmentOwners``), the stages take turns; reference: the
    engine after a disk reload of the same weights; bytes per engine rank / shard from the receiver."""
    out = run_ranks(p2p_workers.sync_then_corrupt, 4, timeout_s=840, args=(
        str(tiny_moe_dir), "tp2pp2", [tp2_engine[0].url], probes(), 2, str(tmp_path), train_sequences(), None))[0]
    assert gap(out["p2p"][0], out["disk"][0])[1] < 1e-5
    metrics = out["metrics"]["p2p"]
    for rank in (0, 1):
        assert metrics[f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)
    assert out["senders"] == [[0, 1], [2, 3]], out["senders"]  # both TP ranks of each stage sent
