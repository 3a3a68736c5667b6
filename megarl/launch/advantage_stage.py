"""The advantage stage of the RL loop: rollout statistics, filters + advantages -> TrainBatch.

:class:`AdvantageStage` is what the driver calls; its parts are pure functions, testable on
hand-made trajectories.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from megarl.algorithms.advantages import estimate_advantages
from megarl.algorithms.corrections import mismatch_metrics
from megarl.algorithms.packing import padded_from_packed
from megarl.config.schema import AlgorithmConfig
from megarl.rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from megarl.training.batch import TrainBatch

logger = logging.getLogger(__name__)

UNTRAINABLE = (RolloutStatus.ABORTED, RolloutStatus.ERROR)
"""Trajectories that never reach the trainer: aborted (over-sampling excess) or failed engines."""


def rollout_metrics(groups: Sequence[TrajectoryGroup], policy_version: int) -> dict[str, float]:
    """Step-level statistics the RolloutManager does not report (its ``rollout/*`` cover lengths,
    turns, tool calls, statuses and throughput).

    Keys: ``rollout/num_trajectories``, ``rollout/reward_{mean,std}`` (all returned trajectories,
    before the driver's filters), ``rollout/staleness_max`` (policy versions the oldest trajectory
    lags behind ``policy_version``).
    """
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {"rollout/num_trajectories": 0.0}
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    return {
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(unbiased=False)),
        "rollout/staleness_max": float(max(policy_version - t.policy_version for t in trajs)),
    }


def oldest_trained_version(trajectory: Trajectory) -> int:
    """The oldest policy version among the trajectory's trained tokens (``loss_mask`` 1): from
    ``token_policy_versions`` when the trajectory spans weight updates, else ``policy_version``."""
    versions = trajectory.token_policy_versions
    if versions is None:
        return int(trajectory.policy_version)
    trained = versions[trajectory.loss_mask.bool()]
    return int(trained.min()) if trained.numel() else int(trajectory.policy_version)


@dataclasses.dataclass
class BatchResult:
    """Output of :func:`build_train_batch`: the batch (None when nothing is left) and its metrics.

    ``route_refs`` (R3): one entry per sequence of ``batch``, the trajectory's ``routed_experts``
    as the rollout actor left it (an object-store reference, or a tensor after a resume), packed
    only on the rank that trains the sequence; ``batch.routed_experts`` is then None. None without R3.
    """

    batch: TrainBatch | None
    metrics: dict[str, float]
    trajectories: list[Trajectory]
    route_refs: list[Any] | None = None


def build_train_batch(groups: Sequence[TrajectoryGroup], *, algorithm: AlgorithmConfig, policy_version: int,
                      max_staleness: int | None = None) -> BatchResult:
    """Filter trajectories and groups, compute group-relative advantages, pack a TrainBatch.

    Filters, in order: aborted / failed trajectories; (async) trajectories more than
    ``max_staleness`` policy versions old; groups with fewer than 2 trajectories left; and, when
    ``algorithm.filter_zero_variance_groups``, groups whose rewards are all equal (zero advantage,
    no signal). Advantages use ``algorithm.advantage_estimator`` within each remaining group.

    Returns:
        The batch and ``filter/*`` metrics (kept counts, dropped counts by reason).
    """
    kept_groups: list[list[Trajectory]] = []
    dropped = {"failed": 0, "stale": 0, "small_group": 0, "zero_variance": 0}
    for group in groups:
        trajs = [t for t in group.trajectories if t.status not in UNTRAINABLE]
        dropped["failed"] += len(group.trajectories) - len(trajs)
        if max_staleness is not None:
            fresh = [t for t in trajs if policy_version - oldest_trained_version(t) <= max_staleness]
            dropped["stale"] += len(trajs) - len(fresh)
            trajs = fresh
        if len(trajs) < 2:
            dropped["small_group"] += len(trajs)
            continue
        group_rewards = [t.reward for t in trajs]
        if algorithm.filter_zero_variance_groups and max(group_rewards) == min(group_rewards):
            dropped["zero_variance"] += len(trajs)
            continue
        kept_groups.append(trajs)
    metrics = {f"filter/dropped_{k}": float(v) for k, v in dropped.items()}
    metrics["filter/kept_groups"] = float(len(kept_groups))
    if kept_groups:
        metrics["filter/trained_staleness_max"] = float(max(
            policy_version - oldest_trained_version(t) for g in kept_groups for t in g))
    metrics["filter/kept_trajectories"] = float(sum(len(g) for g in kept_groups))
    if not kept_groups:
        return BatchResult(None, metrics, [])
    flat = [t for g in kept_groups for t in g]
    rewards = torch.tensor([t.reward for t in flat], dtype=torch.float32)
    group_ids = torch.tensor([i for i, g in enumerate(kept_groups) for _ in g], dtype=torch.int64)
    advantages = estimate_advantages(algorithm, rewards, group_ids)  # with the hyperparameters its entry declares
    metrics["advantages/abs_mean"] = float(advantages.abs().mean())
    return BatchResult(TrainBatch.from_trajectories(flat, advantages, pack_routes=False), metrics, flat,
                       _route_refs(flat))


def _route_refs(trajectories: Sequence[Trajectory]) -> list[Any] | None:
    """Each trajectory's routes (reference or tensor; None: never reached an engine), or None
    when no trajectory has any.

    Raises:
        ValueError: a trajectory with model tokens has no routes while another has them.
    """
    refs = [t.routed_experts for t in trajectories]
    if all(r is None for r in refs):
        return None
    missing = [i for i, t in enumerate(trajectories) if refs[i] is None and t.num_model_tokens > 0]
    if missing:
        raise ValueError(f"trajectory {missing[0]} has no routed_experts while others have them; "
                         f"routing replay needs them for every trajectory")
    return refs


def logprob_mismatch(batch: TrainBatch) -> dict[str, float]:
    """Trainer (``old_logprobs``) vs engine (``rollout_logprobs``) on trained tokens of a whole batch
    (the ranks compute the same per shard and reduce it: `megarl.training.trainer.Trainer.prepare`).

    ``mismatch/log_ratio_abs_mean`` is the mean ``|old_logprob - rollout_logprob|``: right after a
    weight sync both sides hold the same weights, so it measures the sync's fidelity plus kernel
    differences.
    """
    if batch.old_logprobs is None:
        return {}
    padded = [padded_from_packed(x, batch.cu_seqlens) for x in
              (batch.old_logprobs.float(), batch.rollout_logprobs.float(), batch.loss_mask.float())]
    return {k: float(m.value) for k, m in mismatch_metrics(*padded).items()}


@dataclasses.dataclass
class AdvantageStage:
    """Turns a step's rollouts into the trainer's batch: :func:`rollout_metrics`, then
    :func:`build_train_batch` (filters, group-relative advantages, packing)."""

    algorithm: AlgorithmConfig
    """The ``algorithm`` section (filters, advantage estimator)."""
    max_staleness: int | None
    """The staleness bound of the filter (`megarl.launch.pipeline.staleness_bound`; None: on-policy,
    nothing can be stale)."""

    def build(self, rollout: Any, policy_version: int) -> BatchResult:
        """The batch of ``rollout`` (a :class:`~megarl.rollout.manager.RolloutBatch`) for the trainer
        at ``policy_version``; its metrics are the rollout's, :func:`rollout_metrics` and the filters'."""
        built = build_train_batch(rollout.groups, algorithm=self.algorithm, policy_version=policy_version,
                                  max_staleness=self.max_staleness)
        built.metrics = {**rollout.metrics, **rollout_metrics(rollout.groups, policy_version), **built.metrics}
        return built
