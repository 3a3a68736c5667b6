"""The arithmetic task's own tool and reward, loaded by ``plugins:`` in ``arithmetic_tool.yaml``.

Nothing here is part of megarl: the YAML lists this file under ``plugins:``, megarl imports it in the
driver and in every Ray worker before anything is built, and the decorators below register

- ``arithmetic_calculator``: the tool the policy calls as ``calculator`` with
  ``{"expression": "48 + 73"}``; the observation is the value (``121``) or ``Error: ...``. The
  expression is evaluated by megarl's safe arithmetic evaluator (:mod:`ast`-based, no ``eval``).
- ``arithmetic_answer``: reward 1.0 when the final answer of the last turn (its last ``\\boxed{}``,
  else its last number) equals the row's ``answer`` (an integer), else 0.0. Equality is judged by
  math-verify in a worker process (megarl's GSM8K judge), so a reply such as ``\\boxed{121.0}``
  counts and a pathological one cannot block the event loop.

A task of your own follows the same pattern: a module with ``@register_tool`` /
``@register_reward`` classes (or classes named by import path, ``task.py:MyReward``), listed under
``plugins:``; ``megarl validate`` imports it and checks every name before anything starts.
"""
from __future__ import annotations

from typing import Any

from megarl.rollout.rewards import register_reward
from megarl.rollout.rewards.gsm8k import Gsm8kReward
from megarl.rollout.tools import register_tool
from megarl.rollout.tools.calculator import CalculatorTool


@register_tool("arithmetic_calculator")
class ArithmeticCalculator(CalculatorTool):
    """``{"expression": str}`` -> the value as text, or ``Error: ...`` (never raises): megarl's
    ``calculator`` tool (same name, schema and evaluator) registered under this task's own name."""


@register_reward("arithmetic_answer")
class ArithmeticAnswer:
    """1.0 when the last turn's final answer equals ``sample[answer_key]``, else 0.0 (async).

    Args:
        answer_key: the dataset column with the integer answer.
        num_workers: math-verify worker processes.
        timeout_s: a judgement slower than this scores 0.
    """

    def __init__(self, *, answer_key: str = "answer", num_workers: int = 1, timeout_s: float = 10.0) -> None:
        # The GSM8K judge reads the number after "####"; an arithmetic row's answer is that number.
        self._judge = Gsm8kReward(answer_key=answer_key, num_workers=num_workers, timeout_s=timeout_s)

    async def __call__(self, trajectory: Any, sample: dict[str, Any]) -> float:
        return await self._judge(trajectory, sample)

    def close(self) -> None:
        """Stop the judge's worker processes."""
        self._judge.close()
