"""Reward functions (docs/architecture.md ``RewardFn``), selected by registry name (``rollout.reward``).

A reward is called as ``fn(trajectory, sample)`` and returns a float, or an awaitable of one (async
rewards run concurrently). This package imports no torch so that reward worker processes start fast.
"""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable

from megarl.registry import registrar

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
    return registrar(REWARD_REGISTRY, name, "reward")


def reward_factory(name: str) -> Callable[..., "RewardFn"]:
    """What ``rollout.reward`` names, as a factory taking ``rollout.reward_kwargs``.

    A registry name gives its registered factory. An import path (``my_pkg.tasks:ExactMatch``)
    gives a class (instantiated with the keyword arguments) or a function that is itself the reward
    (``fn(trajectory, sample, **reward_kwargs)``).

    Raises:
        megarl.plugins.PluginError: unknown name, or an import path that cannot be loaded.
    """
    from megarl.plugins import resolve

    obj = resolve(name, REWARD_REGISTRY, key="rollout.reward", kind="reward")
    if name in REWARD_REGISTRY or inspect.isclass(obj):
        return obj
    return lambda **kwargs: functools.partial(obj, **kwargs) if kwargs else obj


def build_reward(name: str, **kwargs: Any) -> "RewardFn":
    """Instantiate the reward named ``rollout.reward`` (registry name or import path) with
    ``rollout.reward_kwargs``.

    Raises:
        ValueError: unknown name or import path, or keyword arguments the reward does not take.
    """
    factory = reward_factory(name)
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"rollout.reward_kwargs: {e}") from e


async def compute_reward(fn: "RewardFn", trajectory: "Trajectory", sample: dict[str, Any]) -> float:
    """Call a sync or async reward and return its float value."""
    value = fn(trajectory, sample)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


from megarl.rollout.rewards import gsm8k  # noqa: E402,F401  (registers "gsm8k")  isort: skip
from megarl.rollout.rewards import composite, judge, terms  # noqa: E402,F401  isort: skip

__all__ = ["FINAL_TEXT_KEY", "REWARD_REGISTRY", "build_reward", "compute_reward", "register_reward",
           "reward_factory"]
