"""Rollout metrics. Keys are ``rollout/<name>``; the suffix names the reduction.

Per-trajectory statistics come from the trajectories' ``metadata`` as the agent loop records it
(``tool_calls``, ``tool_errors``, ``tool_time_s``, ``finish_reasons`` of every generate call,
``input_tokens`` and ``cached_tokens`` summed over calls, ``orchestration_s``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from megarl.rollout.rewards.composite import reward_term_metrics
from megarl.rollout.types import RolloutStatus, Trajectory

FINISH_REASONS = ("stop", "length", "abort")


def _quantiles(values: list[float], prefix: str) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {f"{prefix}_mean": float(t.mean()), f"{prefix}_min": float(t.min()),
            f"{prefix}_max": float(t.max()), f"{prefix}_p50": float(t.quantile(0.5)),
            f"{prefix}_p90": float(t.quantile(0.9))}


def trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Statistics over trajectories.

    Keys: ``response_tokens_{mean,min,max,p50,p90}`` (model + tool tokens),
    ``model_tokens_mean``, ``turns_{mean,max}``, ``tool_calls_mean`` and ``tool_errors_mean`` (per
    trajectory), ``tool_error_frac`` (errors / calls), ``tool_time_s_{mean,sum}``,
    ``finish_reason/<r>_frac`` (over generate calls), ``status/<s>_frac`` (over trajectories),
    ``prefix_cache_hit_rate`` (cached / input prompt tokens over all generate calls),
    ``orchestration_ms_per_turn_mean``, ``reward_{mean,std}``; all under ``rollout/``.
    """
    if not trajectories:
        return {"rollout/num_trajectories": 0.0}
    meta = [t.metadata for t in trajectories]
    out = {"rollout/num_trajectories": float(len(trajectories))}
    out.update(_quantiles([float(t.num_response_tokens) for t in trajectories],
                          "rollout/response_tokens"))
    turns = torch.tensor([float(t.num_turns) for t in trajectories])
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    calls = sum(m.get("tool_calls", 0) for m in meta)
    errors = sum(m.get("tool_errors", 0) for m in meta)
    tool_time = [float(m.get("tool_time_s", 0.0)) for m in meta]
    inputs = sum(m.get("input_tokens", 0) for m in meta)
    num_turns = max(float(turns.sum()), 1.0)
    out.update({
        "rollout/model_tokens_mean": sum(t.num_model_tokens for t in trajectories) / len(meta),
        "rollout/turns_mean": float(turns.mean()), "rollout/turns_max": float(turns.max()),
        "rollout/tool_calls_mean": calls / len(meta), "rollout/tool_errors_mean": errors / len(meta),
        "rollout/tool_error_frac": errors / calls if calls else 0.0,
        "rollout/tool_time_s_mean": sum(tool_time) / len(meta), "rollout/tool_time_s_sum": sum(tool_time),
        "rollout/prefix_cache_hit_rate": (sum(m.get("cached_tokens", 0) for m in meta) / inputs
                                          if inputs else 0.0),
        "rollout/orchestration_ms_per_turn_mean":
            1e3 * sum(float(m.get("orchestration_s", 0.0)) for m in meta) / num_turns,
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(unbiased=False)),
    })
    reasons = Counter(r for m in meta for r in m.get("finish_reasons", []))
    total_calls = max(sum(reasons.values()), 1)
    for reason in FINISH_REASONS:
        out[f"rollout/finish_reason/{reason}_frac"] = reasons.get(reason, 0) / total_calls
    statuses = Counter(t.status for t in trajectories)
    for status in RolloutStatus:
        out[f"rollout/status/{status.value}_frac"] = statuses.get(status, 0) / len(trajectories)
    out.update(reward_term_metrics(trajectories))  # reward/<term>, reward/<term>_weight (composite)
    return out


def throughput_metrics(*, generated_tokens: int, wall_s: float) -> dict[str, float]:
    """``rollout/tokens_per_s``: model tokens generated in the step / its wall-clock seconds."""
    return {"rollout/generated_tokens_sum": float(generated_tokens),
            "rollout/tokens_per_s": generated_tokens / wall_s if wall_s > 0 else 0.0,
            "timing/rollout_s": wall_s}


def trajectory_record(trajectory: Trajectory, prompt_index: int) -> dict[str, float | int | str]:
    """One trajectory as the plain numbers an evaluation report is built from (JSON-ready).

    Args:
        trajectory: a finished (or failed) trajectory.
        prompt_index: the position of its prompt in the evaluation set.

    Returns:
        ``prompt`` (index), ``reward``, ``status`` (its value), ``num_turns``, ``tool_calls`` and
        ``tool_errors`` (this trajectory's), ``response_tokens`` (model + tool tokens),
        ``model_tokens``, ``truncated`` (0/1: ``status`` is truncated, or a turn stopped at its
        token limit, finish reason ``length``).
    """
    meta = trajectory.metadata
    truncated = (trajectory.status == RolloutStatus.TRUNCATED
                 or "length" in meta.get("finish_reasons", ()))
    return {"prompt": int(prompt_index), "reward": float(trajectory.reward), "status": trajectory.status.value,
            "num_turns": int(trajectory.num_turns), "tool_calls": int(meta.get("tool_calls", 0)),
            "tool_errors": int(meta.get("tool_errors", 0)),
            "response_tokens": int(trajectory.num_response_tokens), "model_tokens": int(trajectory.num_model_tokens),
            "truncated": int(truncated)}
