"""The metrics of one weight sync, reduced over the trainer group
(:class:`~megarl.weight_sync.sync.WeightSynchronizer`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce
from megarl.weight_sync.engine_slices import PlanError
from megarl.weight_sync.plan import WeightSyncPlan

TIMES = ("weight_sync_s", "engine_paused_s", "gather_s", "convert_s", "quantize_s", "transfer_s", "engine_load_s")
"""Seconds per rank, reduced by max."""
SUMS = ("bytes_sent", "gather_bytes")
"""Bytes per rank, reduced by sum."""


def reduce_sync_stats(plan: WeightSyncPlan, stats: dict[str, float], group, *, replica: int | None,
                      rank_bytes: list | None) -> dict[str, float]:
    """Max of the times and sum of the bytes over trainer ranks, and plan-level byte ratios (collective).

    Args:
        plan: the whole plan; stats: this rank's ``{name: value}`` (:data:`TIMES`, :data:`SUMS`).
        group: the trainer's process group.
        replica: this rank's replica when it is a stage sender (its ``rank_bytes`` count), else None.
        rank_bytes: ``[engine tp rank]`` bytes this sender's transport sent each engine rank.

    Returns:
        ``timing/weight_sync_s``, ``timing/engine_paused_s``, ``weight_sync/<time or sum>``, the
        plan's bucket count and bytes, and per engine rank the bytes received (the replica that
        sent it the most) over its own slices' bytes (``plan.engine_shard_bytes``).
    """
    tp, replicas = plan.engine_layout.tp_size, plan.senders_per_stage
    per_rank = [0.0] * (replicas * tp)  # [replica][engine rank]: summed over the replica's stages
    if replica is not None:
        per_rank[replica * tp:(replica + 1) * tp] = rank_bytes if rank_bytes is not None else [0] * tp
    t = torch.tensor([stats.get(k, 0.0) for k in TIMES], dtype=torch.float64)
    s = torch.tensor([stats.get(k, 0.0) for k in SUMS] + per_rank, dtype=torch.float64)
    all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    received = s[len(SUMS):].view(replicas, tp).max(dim=0).values.tolist()  # the engine rank that got the most
    try:
        shard = plan.engine_shard_bytes()
    except PlanError:  # a tensor the engines take only whole at this layout: no per-rank shard to compare with
        shard = [0] * tp
    out = {(f"timing/{k}" if k in ("weight_sync_s", "engine_paused_s") else f"weight_sync/{k}"): v
           for k, v in zip(TIMES, t.tolist())}
    out.update({f"weight_sync/{k}": v for k, v in zip(SUMS, s[:len(SUMS)].tolist())})
    out.update({"weight_sync/buckets": float(len(plan.buckets)),
                "weight_sync/hf_bytes": float(plan.total_bytes),
                "weight_sync/wire_bytes": float(plan.wire_bytes),
                "weight_sync/engine_rank_bytes_max": max(received),
                "weight_sync/engine_shard_bytes_max": float(max(shard)),
                "weight_sync/engine_bytes_over_shard_max": max((r / n for r, n in zip(received, shard) if n),
                                                                default=0.0),
                "weight_sync/senders_per_stage": float(replicas)})
    for r, (got, own) in enumerate(zip(received, shard)):
        out[f"weight_sync/engine_rank{r}_bytes_over_shard"] = got / own if own else 0.0
    return out
