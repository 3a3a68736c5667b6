"""Weight sync from a 2-rank Megatron trainer (gloo) to real SGLang CPU servers.

References: the trainer's own logprobs (``Trainer.compute_logprobs``) on probe sequences; the disk
transport (``/update_weights_from_disk`` of safetensors) for the other transports; the engine's own
parameter bytes per rank (reported by the custom loader inside the server) for shard delivery.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import workers

TOLERANCE = 1e-3
"""Mean |engine - trainer| logprob allowed after a sync (fp32 on CPU)."""


def probes() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (24, 17, 31)]


def train_sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (12, 20, 9, 16)]


def gap(engine: list[list[float]], reference: list[list[float]]) -> tuple[float, float]:
    diffs = torch.cat([(torch.tensor(e, dtype=torch.float64) - torch.tensor(r, dtype=torch.float64)).abs()
                       for e, r in zip(engine, reference)])
    return diffs.mean().item(), diffs.max().item()


def run(tiny_moe_dir, tmp_path, urls, layouts, transports, engine_tp) -> dict:
    return run_ranks(workers.train_then_sync, 2, timeout_s=540, args=(
        str(tiny_moe_dir), layouts, transports, urls, probes(), engine_tp, str(tmp_path), train_sequences()))[0]


@pytest.mark.timeout(600)
def test_sync_after_training_matches_trainer_at_tp2_ep2_pp2(sglang_engine, tiny_moe_dir, tmp_path):
    """Distributed sync after two training steps at TP2, EP2 and PP2; at TP2 every transport."""
    results = run(tiny_moe_dir, tmp_path, [sglang_engine.url], ["tp2", "ep2", "pp2"],
                  ["distributed", "disk", "shard", "tensor"], engine_tp=1)
    report = {}
    for layout, out in results.items():
        trainer = out["trainer"]
        for transport, after in out["after"].items():
            before_mean, _ = gap(out["before"][transport][0], trainer)
            mean, peak = gap(after[0], trainer)
            report[(layout, transport)] = (before_mean, mean, peak)
            assert before_mean > 20 * TOLERANCE, (layout, transport, before_mean)  # training moved the policy
            assert mean <= TOLERANCE, (layout, transport, mean, peak)
            assert out["stale_detected"][transport]  # verification fails on the engine before the sync ...
            assert out["verify"][transport]["weight_sync/verify_logprob_diff_mean"] <= TOLERANCE  # ... passes after
            metrics = out["metrics"][transport]
            assert metrics["weight_sync/hf_bytes"] == metrics["weight_sync/engine_rank_bytes_max"]
            assert metrics["timing/weight_sync_s"] > 0
        # every transport leaves the engine with identical outputs (the disk transport is the reference)
        for transport in ("distributed", "shard", "tensor"):
            assert out["after"][transport] == out["after"]["disk"], (layout, transport)
    print("\nlayout transport: mean|engine-trainer| before -> after (max after)")
    for (layout, transport), (before, mean, peak) in report.items():
        print(f"  {layout} {transport}: {before:.4f} -> {mean:.2e} (max {peak:.2e})")


def tp2_rank_shard_bytes(model_dir, rank: int) -> int:
    """Bytes of engine rank ``rank``'s shard of the tiny Qwen3-MoE at engine TP=2 on CPU (SGLang's sharding,
    written out): vocab rows / 2, q heads / 2, one of the two kv heads, o_proj columns / 2, norms and router
    whole, and of each expert the real rows (gate/up) and columns (down) of the rank's chunk of
    ``moe_intermediate_size`` padded to a multiple of 64 (SGLang's CPU runner: T x 32,
    ``configs/update_config.py``): 32 -> 64, so rank 0 holds every expert whole and rank 1 none."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, v, hd, nh, nkv = c["hidden_size"], c["vocab_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    e, i = c["num_local_experts"], c["moe_intermediate_size"]
    chunk = -(-i // 64) * 64 // 2
    expert_rows = max(0, min(i, (rank + 1) * chunk) - rank * chunk)
    layer = (nh // 2) * hd * h * 2 + 2 * (nkv // 2) * hd * h + 2 * hd + 2 * h + e * h + e * 3 * expert_rows * h
    return 4 * (c["num_hidden_layers"] * layer + 2 * (v // 2) * h + h)


@pytest.mark.timeout(600)
def test_shard_transport_delivers_exactly_each_ranks_shard_to_a_tp2_engine(tp2_engine, tiny_moe_dir, tmp_path):
    engine, stats = tp2_engine
    results = run(tiny_moe_dir, tmp_path, [engine.url], ["tp2"], ["distributed", "disk", "shard"], engine_tp=2)
    out = results["tp2"]
    for transport in ("distributed", "disk", "shard"):
        before, _ = gap(out["before"][transport][0], out["trainer"])
        mean, peak = gap(out["after"][transport][0], out["trainer"])
        assert before > 20 * TOLERANCE and mean <= TOLERANCE, (transport, before, mean, peak)
    assert out["after"]["distributed"] == out["after"]["disk"]
    # Each rank receives what SGLang's own load from disk puts there (the whole experts on rank 0, whose
    # padded chunk holds all 32 real rows; none on rank 1): the same parameters, so the same outputs.
    assert gap(out["after"]["shard"][0], out["after"]["disk"][0])[1] < 1e-6
    # Inside the server: the bytes each rank's loader received == that rank's shard, written out above.
    physical = []
    whole = out["metrics"]["distributed"]["weight_sync/wire_bytes"]
    for rank in (0, 1):
        expected = tp2_rank_shard_bytes(tiny_moe_dir, rank)
        rows = [json.loads(line) for line in (stats / f"rank{rank}.jsonl").read_text().splitlines()]
        assert sum(r["bytes_received"] for r in rows) == expected, (rank, rows)
        physical.append(expected / rows[-1]["param_bytes"])
        assert out["metrics"]["shard"][f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0)
        assert out["metrics"]["distributed"][f"weight_sync/engine_rank{rank}_bytes_over_shard"] == \
            pytest.approx(whole / expected)
    print(f"\nTP=2 engine, bytes received / shard: shard "
          f"{[out['metrics']['shard'][f'weight_sync/engine_rank{r}_bytes_over_shard'] for r in (0, 1)]}, "
          f"distributed {[round(out['metrics']['distributed'][f'weight_sync/engine_rank{r}_bytes_over_shard'], 3) for r in (0, 1)]}; "
          f"shard / SGLang's CPU parameter bytes (with its expert padding) {[round(x, 3) for x in physical]}")


@pytest.mark.timeout(300)
def test_sglang_ignores_a_misnamed_tensor_so_the_plan_check_refuses_it(sglang_engine, tiny_moe_dir):
    """Why names are checked on the trainer side: SGLang answers success for a name it does not know."""
    from transformers import AutoConfig

    from megarl.weight_sync.engine_clients import EngineClients
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.manifest_checks import WeightSyncError, read_manifest
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.sync import WeightSynchronizer

    probe = probes()[:1]
    with EngineClients([sglang_engine.url]) as engines:
        before = workers.engine_logprobs([sglang_engine.url], probe)
        engines.call_all("begin_weight_update")
        try:
            result = engines.call_all("update_weights_from_tensor",
                                      [[("model.layers.0.mlp.experts.0.gate_projj.weight", torch.zeros(32, 64))]])
        finally:
            engines.call_all("end_weight_update")
        assert result[0]["success"] is True  # silently ignored ...
        assert workers.engine_logprobs([sglang_engine.url], probe) == before  # ... and nothing changed
    specs = param_specs_from_hf_config(AutoConfig.from_pretrained(tiny_moe_dir), dtype="float32")
    bad = [dataclasses.replace(s, hf=tuple(dataclasses.replace(t, name=t.name.replace("gate_proj", "gate_projj"))
                                            for t in s.hf)) if s.expert == 0 else s for s in specs]
    plan = build_plan(TrainerLayout(), EngineLayout(), bad)
    with pytest.raises(WeightSyncError, match="unknown to the engine"):
        WeightSynchronizer(plan, "distributed", [sglang_engine.url], rank=0, placement=None,
                           manifest=read_manifest(tiny_moe_dir))
