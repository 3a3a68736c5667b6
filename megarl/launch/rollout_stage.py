"""The rollout stage of the RL loop: prompts drawn in step order, rollouts on the rollout actor, the
asynchronous pipeline's rollouts in flight, engines put back into service before a step's batch is used.

:class:`RolloutStage` owns the prompt dataset and its resumable sampler and the rollouts in flight
(``depth`` of them while a step trains, `megarl.launch.pipeline.pipeline_depth`; none in synchronous
mode). A rollout starts at the engines' weight version (the last synced one: with
``weight_sync.every_n_steps > 1`` it may be older than the trainer's policy version).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray

from megarl.config.schema import RolloutConfig
from megarl.data.datasets import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.rollout.manager import RolloutBatch

logger = logging.getLogger("megarl.train")


@dataclasses.dataclass
class PendingRollout:
    """One step's rollout, in flight (a Ray reference) or finished, with the prompts it started from
    (a failed rollout is generated again from the same rows, hence with the same sampling seeds)."""

    step: int
    rows: list[dict]
    result: Any
    policy_version: int = 0
    """The engines' weight version when the rollout started."""

    def wait(self) -> RolloutBatch:
        """The :class:`~megarl.rollout.manager.RolloutBatch` (blocks while in flight)."""
        if isinstance(self.result, ray.ObjectRef):
            self.result = ray.get(self.result)
        return self.result


@dataclasses.dataclass
class RolloutStage:
    """Each step's rollouts (module docstring)."""

    rollout: RolloutConfig
    """The ``rollout`` section (prompts per step, over-sampling)."""
    dataset: PromptDataset
    """The training prompts."""
    sampler: ResumableSampler
    """Their order (resumable: its state is saved with each checkpoint)."""
    rollout_actor: Any
    """The :class:`~megarl.launch.rollout_actor.RolloutWorker` handle."""
    num_steps: int
    """``train.num_steps`` (no rollout starts for a step past the end)."""
    depth: int
    """Rollouts in flight while a step trains (0: synchronous)."""
    sync: Any
    """The weight sync: its ``synced_version`` is the engines' weight version."""
    heal: Callable[[int], list[str]]
    """``heal(policy_version)`` puts every engine back into service and returns the ids of those it
    put back (:func:`megarl.cluster.ray_engines.heal_engines`)."""
    in_flight: collections.deque[PendingRollout] = dataclasses.field(default_factory=collections.deque)
    """The rollouts started for the steps ahead, oldest first."""

    def restore(self, sampler_state: dict[str, Any], saved: list[dict[str, Any]]) -> None:
        """A checkpoint's prompt order and rollouts in flight (``RunState.pending_rollouts``)."""
        self.sampler.load_state_dict(sampler_state)
        self.in_flight.extend(PendingRollout(s["step"], s["rows"], RolloutBatch(groups=s["groups"],
                                                                                metrics=s["metrics"]),
                                             s.get("policy_version", 0)) for s in saved)

    def start(self, step: int, rows: list[dict] | None = None) -> PendingRollout:
        """Start step ``step``'s rollout (on the next prompts, or ``rows``) at the engines' version."""
        if rows is None:
            count = int(self.rollout.num_prompts_per_step) + int(self.rollout.over_sample_prompts)
            rows = [self.dataset[i] for i in self.sampler.next_indices(count)]
        version = self.sync.synced_version
        return PendingRollout(step, rows, self.rollout_actor.generate.remote(rows, step, version), version)

    def top_up(self, next_step: int) -> None:
        """Start rollouts for the steps from ``next_step`` on until ``depth`` are in flight (they are
        consecutive steps, oldest first, so prompts are drawn in step order)."""
        while len(self.in_flight) < self.depth and next_step + len(self.in_flight) < self.num_steps:
            self.in_flight.append(self.start(next_step + len(self.in_flight)))

    def take(self, step: int, policy_version: int) -> RolloutBatch:
        """Step ``step``'s rollouts, groups in prompt order; in async mode the pipeline is topped up
        first (the next rollouts start before this step trains). Engines out of service are put back
        (re-admitted, or restarted and re-synced to ``policy_version``); if that cost trajectories,
        the step is generated again from the same prompts.

        Raises:
            RuntimeError: the rollout in flight is for another step.
        """
        self.top_up(step)
        current = self.in_flight.popleft() if self.in_flight else self.start(step)
        if current.step != step:
            raise RuntimeError(f"the rollout in flight is for step {current.step}, the driver is at step {step}")
        rollout = current.wait()
        restarted = self.heal(policy_version)
        if restarted and (not rollout.groups or rollout.metrics.get("rollout/groups_dropped_error", 0) > 0):
            logger.warning("step %d lost trajectories with %s; generating its rollouts again (same prompts, same "
                           "seeds)", step + 1, ", ".join(restarted))
            rollout = self.start(step, current.rows).wait()
        rollout.groups.sort(key=lambda g: g.group_id)  # completion order -> prompt order: a deterministic batch
        if rollout.sample_text:
            logger.info("step %d rollout sample: %s", step + 1, rollout.sample_text)
        rollout.metrics["engine/restarts"] = float(len(restarted))
        rollout.metrics["rollout/in_flight"] = float(len(self.in_flight))
        self.top_up(step + 1)
        return rollout
