"""Reward functions (docs/architecture.md ``RewardFn``), selected by registry name (``rollout.reward``).

A reward is called as ``fn(trajectory, sample)`` and returns a float, or an awaitable of one (async
rewards run concurrently). This package imports no torch so that reward worker processes start fast.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from megarl.rollout.types import RewardFn, Trajectory

FINAL_TEXT_KEY = "final_text"
"""``Trajectory.metadata`` key holding the answer of the last model turn: its decoded text outside
the reasoning block (set by the agent loops; what text-based rewards score, so nothing written while
thinking earns a reward)."""

REASONING_TEXT_KEY = "reasoning_text"
"""``Trajectory.metadata`` key holding the reasoning of the last model turn ("" when it has none);
for format terms of a reward, never for its answer."""

REWARD_REGISTRY: dict[str, Callable[..., "RewardFn"]] = {}
"""Registry name -> reward class (or factory) taking ``rollout.reward_kwargs`` as keyword arguments."""


def register_reward(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a reward factory to :data:`REWARD_REGISTRY`.

    Raises:
        ValueError: ``name`` is already registered to something else.
    """
    def decorator(factory):
        if name in REWARD_REGISTRY and REWARD_REGISTRY[name] is not factory:
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_REGISTRY[name] = factory
        return factory
    return decorator


def build_reward(name: str, **kwargs: Any) -> "RewardFn":
    """Instantiate the reward named ``rollout.reward`` with ``rollout.reward_kwargs``.

    Raises:
        ValueError: unknown name, or keyword arguments the reward does not take.
    """
    if name not in REWARD_REGISTRY:
        raise ValueError(f"rollout.reward: unknown reward {name!r} (known: {sorted(REWARD_REGISTRY)})")
    try:
        return REWARD_REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"rollout.reward_kwargs: {e}") from e


async def compute_reward(fn: "RewardFn", trajectory: "Trajectory", sample: dict[str, Any]) -> float:
    """Call a sync or async reward and return its float value."""
    value = fn(trajectory, sample)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


from megarl.rollout.rewards import gsm8k  # noqa: E402,F401  (registers "gsm8k")  isort: skip
from megarl.rollout.rewards import composite, terms  # noqa: E402,F401  isort: skip

__all__ = ["FINAL_TEXT_KEY", "REWARD_REGISTRY", "build_reward", "compute_reward", "register_reward"]
