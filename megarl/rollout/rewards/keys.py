"""The ``Trajectory.metadata`` keys the agent loops write and the rewards read."""
from __future__ import annotations

FINAL_TEXT_KEY = "final_text"
"""``Trajectory.metadata`` key holding the answer of the last model turn: its decoded text outside
the reasoning block (set by the agent loops; what text-based rewards score, so nothing written while
thinking earns a reward)."""

REASONING_TEXT_KEY = "reasoning_text"
"""``Trajectory.metadata`` key holding the reasoning of the last model turn ("" when it has none);
for format terms of a reward, never for its answer."""

TERMS_KEY = "reward_terms"
"""``Trajectory.metadata`` key holding the reward's terms ``{name: value}`` (a composite reward: its
weighted terms; ``gsm8k``: ``correct`` and ``boxed``), recorded with the trajectory for ``megarl show``."""

GOLD_KEY = "reward_gold"
"""``Trajectory.metadata`` key holding the reference answer the reward compared with (``gsm8k``)."""
