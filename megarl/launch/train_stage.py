"""The train stage of the RL loop: one RL step on the trainer ranks, and the policy version it makes.

Per step (:meth:`TrainStage.step`): the engines lend their GPU memory to the trainer (colocated,
synchronous: :class:`megarl.cluster.colocated.EngineMemoryLoan`) -> the batch is cut into one shard
per data-parallel rank (`megarl.training.shard.shard_batch`; R3 routes stay object-store references
until the rank that trains a sequence reads them) -> old / reference logprobs on the ranks
(``timing/logprobs_s``) -> one optimizer step per mini-batch (``timing/train_s``) -> the memory is
given back -> the policy version advances by one.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.algorithms.metrics import mean_over_steps
from megarl.cluster.colocated import EngineMemoryLoan
from megarl.launch.advantage_stage import BatchResult
from megarl.launch.metric_sinks import StageTimer
from megarl.training.shard import shard_batch


@dataclasses.dataclass
class TrainStage:
    """The trainer ranks' part of an RL step (module docstring)."""

    trainer: Any
    """The :class:`~megarl.launch.trainer_group.TrainerGroup` (``dp_size``, ``cp_size``, ``prepare``,
    ``train_step``)."""
    loan: EngineMemoryLoan
    """The engines' memory lent around the step (a loan that does not lend is a no-op)."""
    global_batch_size: int
    """``train.global_batch_size``: sequences per optimizer step."""
    policy_version: int = 0
    """Optimizer steps taken: the version of the trainer's weights (a resumed checkpoint's at the start)."""

    def step(self, built: BatchResult, timer: StageTimer) -> dict[str, float]:
        """Train on ``built.batch`` (not None); returns the ranks' metrics (``loss/*``, ``mismatch/*``,
        ``train/*``, averaged over the optimizer steps) and advances :attr:`policy_version`.

        Raises:
            ValueError: ``built`` has no batch (every group was filtered: the loop skips training).
        """
        if built.batch is None:
            raise ValueError("TrainStage.step: no batch to train on (every group was filtered)")
        self.loan.release()
        shards = shard_batch(built.batch, dp_size=self.trainer.dp_size, cp_size=self.trainer.cp_size,
                             global_batch_size=self.global_batch_size, route_refs=built.route_refs)
        with timer("logprobs"):  # old / ref logprobs, R2 routes, mismatch: computed and kept on the ranks
            metrics = dict(self.trainer.prepare(shards))
        with timer("train"):
            metrics.update(mean_over_steps([self.trainer.train_step(m) for m in range(shards[0].num_minis)]))
        self.loan.resume()
        self.policy_version += 1
        return metrics
