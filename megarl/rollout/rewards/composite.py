"""Composite reward: a weighted sum of named terms, each weight following a schedule over steps.

    rollout:
      reward: composite
      reward_kwargs:
        terms:
          outcome: {fn: exact_match, weight: 1.0}
          format:  {fn: answer_format, weight: [[0, 0.2], [20, 0.0]]}   # dense early, gone by step 20
          tools:   {fn: tool_success_rate, weight: [[0, 0.1], [10, 0.0]]}
          length:  {fn: overlong_penalty, kwargs: {max_tokens: 512, buffer_tokens: 128}}

``reward(step) = sum_i w_i(step) * term_i(trajectory, sample)``. A term's ``fn`` is any registered
reward (:data:`~megarl.rollout.rewards.reward_registry.REWARD_REGISTRY`: the terms of
:mod:`~megarl.rollout.rewards.terms`, ``gsm8k``, ``judge``, a plugin's) built with its ``kwargs``; a
``weight`` is a number (constant, default 1.0) or a piecewise-linear schedule ``[[step, weight],
...]`` with increasing steps, held at its first / last value outside them.

The step is the trajectory's ``policy_version`` (optimizer steps taken before its first token was
generated: the training step in on-policy runs). Terms run concurrently (async terms, e.g. a
judge). A term that raises makes the whole reward raise: the manager then marks the trajectory
ERROR and counts it (``rollout/groups_dropped_error``), never a silent 0.

Logged per step (:func:`reward_term_metrics`, over the step's trajectories): ``reward/<term>`` the
mean unweighted term value, ``reward/<term>_weight`` its weight at that step. Each trajectory keeps
them in ``metadata["reward_terms"]`` and ``metadata["reward_weights"]``.
"""
from __future__ import annotations

import asyncio
import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.rollout.rewards.keys import TERMS_KEY
from megarl.rollout.rewards.reward_registry import build_reward, compute_reward, register_reward

if TYPE_CHECKING:
    from megarl.rollout.types import Trajectory

WEIGHTS_KEY = "reward_weights"


class WeightSchedule:
    """A weight as a function of the step: constant, or piecewise linear through ``points``.

    Args:
        spec: a number, or ``[[step, weight], ...]`` with strictly increasing integer steps.
        where: the config key (for error messages).

    Raises:
        ValueError: any other shape, or steps not increasing.
    """

    def __init__(self, spec: Any, where: str = "weight") -> None:
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            self.steps, self.values = [0], [float(spec)]
            return
        try:
            points = [(int(s), float(w)) for s, w in spec]
        except (TypeError, ValueError):
            raise ValueError(f"{where}: a number or a list of [step, weight] pairs, got {spec!r}") from None
        if not points or any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise ValueError(f"{where}: schedule steps must be non-empty and strictly increasing, got {spec!r}")
        self.steps, self.values = [p[0] for p in points], [p[1] for p in points]

    def __call__(self, step: int) -> float:
        """The weight at ``step`` (linear between points, constant outside)."""
        i = bisect.bisect_right(self.steps, step)
        if i == 0:
            return self.values[0]
        if i == len(self.steps):
            return self.values[-1]
        s0, s1, w0, w1 = self.steps[i - 1], self.steps[i], self.values[i - 1], self.values[i]
        return w0 + (w1 - w0) * (step - s0) / (s1 - s0)


@dataclass
class Term:
    """One term of a :class:`CompositeReward`: its name (the metric key ``reward/<name>``), the
    reward function, and its weight schedule over training steps.
    """
    name: str
    fn: Any
    weight: WeightSchedule


@register_reward("composite")
class CompositeReward:
    """Weighted sum of named reward terms with scheduled weights (see the module docstring).

    Args:
        terms: term name -> ``{fn: registry name, kwargs: {...}, weight: number | [[step, w], ...]}``.

    Raises:
        ValueError: no terms, a term without ``fn``, unknown keys, or a bad schedule (the message
            names ``rollout.reward_kwargs.terms.<name>``).
    """

    def __init__(self, *, terms: Mapping[str, Mapping[str, Any]]) -> None:
        if not terms:
            raise ValueError("rollout.reward_kwargs.terms: at least one term is needed")
        self.terms: list[Term] = []
        for name, spec in terms.items():
            where = f"rollout.reward_kwargs.terms.{name}"
            spec = dict(spec or {})
            unknown = set(spec) - {"fn", "kwargs", "weight"}
            if unknown or "fn" not in spec:
                raise ValueError(f"{where}: expected {{fn, kwargs, weight}}, got keys {sorted(spec)}")
            try:
                fn = build_reward(str(spec["fn"]), **dict(spec.get("kwargs") or {}))
            except (ValueError, KeyError) as e:
                raise ValueError(f"{where}: {e}") from e
            self.terms.append(Term(name, fn, WeightSchedule(spec.get("weight", 1.0), f"{where}.weight")))

    def weights(self, step: int) -> dict[str, float]:
        """Term name -> weight at ``step``."""
        return {t.name: t.weight(step) for t in self.terms}

    async def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        """The weighted sum; records the term values and weights in the trajectory's metadata.

        Raises:
            Exception: whatever a term raises (the trajectory is then marked ERROR by the manager).
        """
        step = int(trajectory.policy_version)
        values = await asyncio.gather(*(compute_reward(t.fn, trajectory, sample) for t in self.terms))
        weights = self.weights(step)
        trajectory.metadata[TERMS_KEY] = {t.name: v for t, v in zip(self.terms, values)}
        trajectory.metadata[WEIGHTS_KEY] = weights
        return float(sum(weights[t.name] * v for t, v in zip(self.terms, values)))

    def drain_metrics(self) -> dict[str, float]:
        """The terms' own counters (e.g. ``judge/*``) since the last call."""
        out: dict[str, float] = {}
        for t in self.terms:
            drain = getattr(t.fn, "drain_metrics", None)
            if drain is not None:
                out.update(drain())
        return out

    async def close(self) -> None:
        """Close every term's reward function that has a ``close`` (awaited when it is a coroutine)."""
        for t in self.terms:
            close = getattr(t.fn, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


def reward_term_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<term>`` (mean unweighted value) and ``reward/<term>_weight`` (mean weight) over the
    trajectories that carry composite-reward terms ({} when none does)."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for key, prefix in ((TERMS_KEY, ""), (WEIGHTS_KEY, "_weight")):
            for name, value in (t.metadata.get(key) or {}).items():
                sums.setdefault(f"reward/{name}{prefix}", []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items()}
