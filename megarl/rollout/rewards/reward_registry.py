"""The reward registry (``rollout.reward``): registry names and import paths -> reward functions.

A reward is called as ``fn(trajectory, sample)`` and returns a float, or an awaitable of one (async
rewards run concurrently). The built-in rewards register here when :mod:`megarl.rollout.rewards` is
imported (importing this module imports that package first).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megarl.registry import Registry

if TYPE_CHECKING:
    from megarl.rollout.types import RewardFn, Trajectory

REWARD_REGISTRY: Registry[Callable[..., RewardFn]] = Registry("reward", "rollout.reward")
"""Registry name -> reward class (or factory) taking ``rollout.reward_kwargs`` as keyword arguments."""


def register_reward(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a reward factory to :data:`REWARD_REGISTRY`.

    Raises:
        ValueError: ``name`` is already registered to something else.
    """
    return REWARD_REGISTRY.register(name)


def reward_factory(name: str) -> Callable[..., RewardFn]:
    """What ``rollout.reward`` names, as a factory taking ``rollout.reward_kwargs``.

    A registry name gives its registered factory. An import path (``my_pkg.tasks:ExactMatch``)
    gives a class (instantiated with the keyword arguments) or a function that is itself the reward
    (``fn(trajectory, sample, **reward_kwargs)``).

    Raises:
        megarl.plugins.PluginError: unknown name, or an import path that cannot be loaded.
    """
    obj = REWARD_REGISTRY.resolve(name)
    if name in REWARD_REGISTRY or inspect.isclass(obj):
        return obj

    reward: Any = obj  # a function that is itself the reward, with reward_kwargs bound

    def factory(**kwargs: Any) -> RewardFn:
        return functools.partial(reward, **kwargs) if kwargs else reward

    return factory


def build_reward(name: str, **kwargs: Any) -> RewardFn:
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


async def compute_reward(fn: RewardFn, trajectory: Trajectory, sample: dict[str, Any]) -> float:
    """Call a sync or async reward and return its float value."""
    value = fn(trajectory, sample)
    if inspect.isawaitable(value):
        value = await value
    return float(value)
