"""The evaluation stage of the RL loop: greedy accuracy on the held-out rows (``data.eval_path``)
every ``data.eval_interval`` steps, before training and after the last step.

The rollout actor scores the rows (:meth:`megarl.launch.rollout_actor.RolloutWorker.evaluate`) on
the engines, which serve the trained policy then: a weight sync always precedes an evaluation
(`megarl.launch.pipeline.sync_due`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

logger = logging.getLogger("megarl.train")


@dataclasses.dataclass
class EvalStage:
    """When to evaluate, and the evaluation itself."""

    rows: list[dict] | None
    """The held-out rows (None or empty: never evaluates)."""
    rollout_actor: Any
    """The rollout actor (:class:`~megarl.launch.rollout_actor.RolloutWorker` handle)."""
    interval: int
    """``data.eval_interval`` (0: never)."""
    num_steps: int
    """``train.num_steps`` (the last step is always evaluated)."""

    def due(self, completed_steps: int) -> bool:
        """Whether the evaluation runs after ``completed_steps`` RL steps (0: before training)."""
        if self.interval <= 0:
            return False
        return completed_steps % self.interval == 0 or completed_steps == self.num_steps

    def run(self, policy_version: int) -> dict[str, float]:
        """``eval/*`` metrics of the engines' policy (empty when there are no held-out rows)."""
        if not self.rows:
            return {}
        metrics, sample = ray.get(self.rollout_actor.evaluate.remote(self.rows, policy_version))
        logger.info("eval sample: %s", sample)
        return metrics
