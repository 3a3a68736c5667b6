"""Reward functions (docs/architecture.md ``RewardFn``), selected by registry name (``rollout.reward``).

A reward is called as ``fn(trajectory, sample)`` and returns a float, or an awaitable of one (async
rewards run concurrently). This package imports no torch so that reward worker processes start fast.

The registry and its factories are in :mod:`megarl.rollout.rewards.reward_registry`, the metadata keys the
rewards read in :mod:`megarl.rollout.rewards.keys`; importing this package registers the built-in
rewards (``gsm8k``, ``composite``, ``judge`` and the terms of :mod:`~megarl.rollout.rewards.terms`).
"""
from __future__ import annotations

from megarl.rollout.rewards import gsm8k_answer  # noqa: F401  (registers "gsm8k")  isort: skip
from megarl.rollout.rewards import composite, judge, terms  # noqa: F401  isort: skip
