"""Owner senders (``weight_sync.senders: owner``, what the defaults resolve to here) into a real SGLang
CPU server at TP2 from a real Megatron-Core trainer whose experts are spread over every rank (EP =
world, ETP1, one expert copy) and whose dense layers are TP2 (2 ranks: one dense copy; 4 ranks: two,
which split the parts; or two pipeline stages, which deliver at once in one update request per
engine rank and sync, as the receiver's own record of each request shows).

References: the trainer's own logprobs on probe sequences (``Trainer.compute_logprobs``); the bytes
each trainer rank handed to the engines against ``assign_senders``' plan (no rank sends bytes
another holds: every rank's outgoing bytes are its own parts); the bytes each engine rank received,
counted by the receiver inside the server, against its slice from the plan; a flipped byte in one
sender's part must be refused naming engine, rank, bucket and tensor, and nothing loaded; a sender
that fails mid-bucket must leave nothing loaded and the groups usable for the next sync.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import owner_workers
from test_weight_sync_engine import gap, probes, train_sequences


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout, world", [("tp2_ep2_etp1", 2), ("tp2_dp2_ep4_etp1", 4), ("tp2_pp2_ep2_etp1", 4)])
def test_owner_senders_deliver_each_part_from_its_holder_and_refuse_a_corrupted_part(tp2_engine, tiny_moe_dir,
                                                                                    layout, world):
    out = run_ranks(owner_workers.owner_sync, world, timeout_s=840, args=(
        str(tiny_moe_dir), layout, [tp2_engine[0].url], probes(), 2, train_sequences()))[0]
    assert out["resolved"] == (True, "p2p")  # the default (senders auto, transport auto): owner over p2p
    _assert_one_session_per_sync(tp2_engine[1], out["stage_buckets"], out["rounds"])
    # the engine serves the trained policy: its logprobs are the trainer's to fp32 noise, and the
    # finish vote's load proof passed (the sync returned)
    assert gap(out["engine"][0], out["trainer"])[1] < 1e-4, gap(out["engine"][0], out["trainer"])
    assert out["verify"]["weight_sync/verify_logprob_diff_max"] < 1e-4
    # every trainer rank sent exactly its planned parts, and both sent (experts spread over both)
    assert out["sent"] == out["planned"] and all(n > 0 for n in out["sent"]), (out["sent"], out["planned"])
    # each engine rank received exactly its own slices (counted inside the server)
    for rank in (0, 1):
        assert out["metrics"][f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)
    error, tampered = out["error"], out["tampered"]
    assert error is not None and "checksum mismatch" in error, error
    assert "engine 0" in error and "rank 1" in error and f"bucket {tampered['bucket']}:" in error, error
    assert tampered["tensor"] in error, error
    assert out["after_corrupt"] == out["engine"]  # nothing of the refused bucket was loaded
    # a sender failing before its part for engine rank 1 leaves: its own error on its rank, the
    # others name it as stopped (not the zeros that released the receivers), nothing loaded, and
    # the same groups carry the next sync
    failing, errors = tampered["sender"], out["abort_errors"]
    assert all(e is not None for e in errors) and "injected sender failure" in errors[failing], errors
    others = [e for r, e in enumerate(errors) if r != failing]
    assert any(f"trainer rank {failing}" in e and "stopped mid-stage" in e for e in others), errors
    assert not any("checksum" in e for e in others), errors
    assert out["after_abort"] == out["engine"]
    assert gap(out["engine_after"][0], out["trainer_after"])[1] < 1e-4
    assert out["engine_after"] != out["engine"]  # the trainer moved on: the last sync delivered it
    print(f"\nowner senders, trainer {layout} -> engine TP2: sent per trainer rank {out['sent']}; "
          f"refused: {error[:300]}")


def _assert_one_session_per_sync(stats_dir, stage_buckets: list[list[int]], rounds: list[list[int]]) -> None:
    """Every update request an engine rank served (``receiver_rank{r}.jsonl``, written by the
    receiver inside the server) carried every stage's buckets in the planned rounds
    (``OwnerParts.rounds``: several buckets of a stage in one round, the stages together), all
    through one group: one session per sync whatever PP is (a request per stage would list one
    stage's buckets, and a group per stage would make several)."""
    import json

    everything = sorted(b for s in stage_buckets for b in s)
    assert sorted(b for r in rounds for b in r) == everything, (rounds, stage_buckets)
    assert len(rounds) > 1 and max(map(len, rounds)) > 1, rounds  # several rounds, several buckets in one
    for rank in (0, 1):
        rows = [json.loads(line) for line in (Path(stats_dir) / f"receiver_rank{rank}.jsonl").read_text().splitlines()]
        assert len(rows) >= 4, rows  # four syncs: good, corrupted, aborted, good
        assert len({r["group"] for r in rows}) == 1, rows
        for row in rows:
            assert row["buckets"] == [b for r in rounds for b in r] and row["rounds"] == [len(r) for r in rounds], \
                (row, rounds)
    if len(stage_buckets) > 1:  # the stages' buckets travel together
        assert any(len({next(k for k, s in enumerate(stage_buckets) if b in s) for b in r}) > 1 for r in rounds)
