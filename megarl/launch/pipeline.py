"""How far generation may run ahead of training: the asynchronous pipeline's arithmetic.

Policy versions: the trainer's version ``v`` counts optimizer steps; RL step ``s`` trains version
``v(s)`` (``v(s) = s`` when no step is skipped). A trajectory's staleness when trained is
``v(s) - v_start``, where ``v_start`` is the engines' weight version when its first model token was
generated (megarl.rollout.types.Trajectory.policy_version).

- ``weight_sync.every_n_steps = n``: the engines are updated after every n-th optimizer step, so
  they lag the trainer by up to ``n - 1`` versions.
- ``rollout.async_mode``: the rollouts of the next ``depth`` steps are in flight while a step
  trains. The rollout of step ``s + depth`` starts right after step ``s``'s rollout is taken (before
  step ``s`` trains), at an engine version >= ``v(s) - (n - 1)``, and is trained at ``v(s + depth)
  <= v(s) + depth``: staleness <= ``depth + n - 1``.

So ``depth = max_staleness - (n - 1)`` is the deepest pipeline whose trajectories can all be
trained within ``rollout.max_staleness``; generation never produces older ones by construction.
A trajectory can still come out older when steps are skipped (every group filtered) or a partial
rollout is carried over from an earlier step: the driver's staleness filter drops those and counts
them (``filter/dropped_stale``). Sync mode has depth 0 and needs ``max_staleness >= n - 1``.
"""
from __future__ import annotations


def staleness_floor(every_n_steps: int) -> int:
    """The staleness the weight-sync cadence alone causes: ``every_n_steps - 1``."""
    return max(0, int(every_n_steps) - 1)


def pipeline_depth(async_mode: bool, max_staleness: int, every_n_steps: int) -> int:
    """How many steps' rollouts are in flight while a step trains (0 = synchronous).

    Raises:
        ValueError: async mode whose ``max_staleness`` leaves no room after the sync cadence.
    """
    if not async_mode:
        return 0
    depth = int(max_staleness) - staleness_floor(every_n_steps)
    if depth < 1:
        raise ValueError(f"rollout.max_staleness={max_staleness} with weight_sync.every_n_steps={every_n_steps} "
                         f"leaves no rollout in flight: async mode needs max_staleness >= every_n_steps")
    return depth


def staleness_bound(async_mode: bool, max_staleness: int, every_n_steps: int) -> int | None:
    """The bound the driver's filter enforces (None: on-policy, nothing can be stale)."""
    if async_mode or staleness_floor(every_n_steps) > 0:
        return int(max_staleness)
    return None


def sync_due(policy_version: int, every_n_steps: int, *, last_step: bool, eval_next: bool) -> bool:
    """Whether the engines are updated after the optimizer step that made ``policy_version``:
    every ``every_n_steps`` versions, and always before an evaluation or the end of the run (so
    evaluations and the final engines serve the trained policy)."""
    return policy_version % max(1, int(every_n_steps)) == 0 or last_step or eval_next
