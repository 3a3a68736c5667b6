"""Bytes one RL step moves through the driver, at DP 1 / 2 / 4, vs the old whole-batch path.

A real Ray `TrainerGroup` of CPU ranks (the tiny Qwen3-MoE of ``megarl.models.tiny``, R3 routes
in the object store as the rollout actor leaves them) runs one RL step's calls
(`TrainerGroup.prepare`, one `train_step` per optimizer step) on the same global batch at DP 1
(TP 2), DP 2 and DP 4; `megarl.testing.driver_bytes.step_bytes` counts pickled bytes: what the driver
gets back from the ranks, what each rank reads (its shard + its routes), and the old path's (every
rank read the whole batch and returned it prepared). Then `megarl.launch.data_plan.plan_step_bytes`
predicts the same quantities for the shipped GPU recipe at its real size. Prints a table and a JSON line.

usage: python tools/benchmarks/driver_bytes.py [--num-seqs 64] [--recipe configs/qwen3_30b_a3b_gpu.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _batch(vocab: int, num_seqs: int, layers: int, topk: int, experts: int):
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(32, 96, (num_seqs,), generator=gen)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    mask = torch.ones(int(cu[-1]), dtype=torch.bool)
    mask[cu[:-1]] = False
    batch = TrainBatch(input_ids=torch.randint(0, vocab, (int(cu[-1]),), generator=gen), cu_seqlens=cu,
                       loss_mask=mask, advantages=torch.randn(num_seqs, generator=gen),
                       rollout_logprobs=torch.where(mask, -2.0, 0.0))
    routes = [torch.argsort(torch.rand(int(n) * layers, experts, generator=gen), dim=-1)[:, :topk]
              .reshape(int(n), layers, topk).to(torch.int32) for n in lens]
    return batch, routes


def _cfg(hf_dir: str, world: int, tp: int, global_batch: int):
    from megarl.config.loader import load_config

    return load_config(None, [
        f"model.hf_path={hf_dir}", "cluster.device=cpu", "cluster.trainer_nodes=1",
        f"cluster.trainer_devices_per_node={world}", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.sequence_parallel={str(tp > 1).lower()}", "rollout.num_engines=0", "train.precision=fp32",
        "train.routing_replay=r3", f"train.global_batch_size={global_batch}",
        "train.max_tokens_per_microbatch=512"])


def measure(hf_dir: str, num_seqs: int, global_batch: int) -> list[dict]:
    """One row per DP size: the measured bytes of one RL step (see the module docstring)."""
    import ray
    from transformers import AutoConfig

    from megarl.cluster.bundles import bundle_shapes
    from megarl.cluster.placement import build_placement, init_ray
    from megarl.launch.trainer_group import TrainerGroup
    from megarl.testing.driver_bytes import step_bytes

    hf = AutoConfig.from_pretrained(hf_dir)
    batch, routes = _batch(hf.vocab_size, num_seqs, hf.num_hidden_layers, hf.num_experts_per_tok, hf.num_experts)
    rows = []
    started = init_ray(_cfg(hf_dir, 4, 1, global_batch), cuda=False)  # cluster.device=cpu
    try:
        for world, tp in ((2, 2), (2, 1), (4, 1)):
            cfg = _cfg(hf_dir, world, tp, global_batch)
            placement = build_placement(cfg, bundle_shapes(cfg))
            group = TrainerGroup(cfg, placement)
            try:
                counted, metrics = step_bytes(group, batch, routes, global_batch_size=global_batch)
            finally:
                group.shutdown()
                ray.util.remove_placement_group(placement.trainer_pg)
            rows.append({"dp": group.dp_size, "world": world, "tokens": batch.num_tokens,
                         "optimizer_steps": len(metrics), "loss_policy": metrics[0]["loss/policy"], **counted})
    finally:
        if started:
            ray.shutdown()
    return rows


def recipe_plan(recipe: str) -> dict:
    """`plan_step_bytes` of a GPU recipe at its real size (its ``config.json``)."""
    from megarl.config.loader import load_config
    from megarl.launch.data_plan import plan_step_bytes

    cfg = load_config(recipe, [])
    model = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    return vars(plan_step_bytes(cfg, model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--hf-dir", default=None, help="an MoE HF dir (default: a fresh tiny Qwen3-MoE)")
    parser.add_argument("--recipe", default="configs/qwen3_30b_a3b_gpu.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if hf_dir is None:
            from megarl.models.tiny import TinyModelSpec, make_tiny_model

            hf_dir = str(make_tiny_model(Path(tmp) / "tiny_moe", TinyModelSpec(family="qwen3_moe")))
        rows = measure(hf_dir, args.num_seqs, args.global_batch)
    print(f"{'DP':>3} {'world':>5} {'driver recv B':>14} {'old driver B':>13} {'ratio':>7} "
          f"{'rank recv B (max)':>18} {'old rank B':>11} {'ratio':>6}")
    for r in rows:
        rank = max(r["rank_received"])
        print(f"{r['dp']:>3} {r['world']:>5} {r['driver_received']:>14,} {r['baseline_driver_received']:>13,} "
              f"{r['driver_received'] / r['baseline_driver_received']:>7.3f} {rank:>18,} "
              f"{r['baseline_rank_received']:>11,} {rank / r['baseline_rank_received']:>6.3f}")
    plan = recipe_plan(args.recipe)
    print(f"\n{args.recipe} at its real size (plan_step_bytes):")
    for key, value in plan.items():
        print(f"  {key:32s} {value / 1e9:10.4f} GB" if key.endswith("_bytes") else f"  {key:32s} {value:,.0f}")
    print(json.dumps({"measured": rows, "recipe_plan": plan}))


if __name__ == "__main__":
    main()
