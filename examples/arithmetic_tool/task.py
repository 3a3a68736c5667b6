"""The arithmetic task's own code: prompts, SFT demonstrations, tool and reward (nothing here is megarl).

``arithmetic_tool.yaml`` lists this file under ``plugins:``; megarl imports it in the driver and in
every Ray worker before anything is built, and the decorators below register

- ``arithmetic_calculator``: the tool the policy calls as ``calculator`` with
  ``{"expression": "48 + 73"}``; the observation is the value (``121``) or ``Error: ...``. The
  expression is evaluated by megarl's safe arithmetic evaluator (:mod:`ast`-based, no ``eval``).
- ``arithmetic_answer``: reward 1.0 when the final answer of the last turn (its last ``\\boxed{}``,
  else its last number) equals the row's ``answer`` (an integer), else 0.0. Equality is judged by
  math-verify in a worker process (megarl's GSM8K judge), so a reply such as ``\\boxed{121.0}``
  counts and a pathological one cannot block the event loop.

The SFT cold start's builder is named by import path, ``sft.demonstrations:
examples/arithmetic_tool/task.py:demonstrations``; ``make_data.py`` writes the prompts with
:func:`make_arithmetic_rows` and :func:`split_disjoint`.

Why this task: a tiny model cannot add multi-digit numbers in its head, but it can learn to call a
calculator and copy the result. The task rewards a *choice* the policy makes (call the tool, copy the
expression exactly, copy the result into ``\\boxed{}``) that sampling can discover and GSPO can
reinforce. Rows: ``{"question": 'What is "48 + 73"?', "answer": "121", "expression": "48 + 73"}``.
Demonstrations are chat messages in the OpenAI format the chat template renders: either a calculator
call then ``\\boxed{result}``, or a direct answer without the tool.

A task of your own follows the same pattern: a module with ``@register_tool`` /
``@register_reward`` classes (or objects named by import path, ``task.py:MyReward``), listed under
``plugins:``; ``megarl validate`` imports it and checks every name before anything starts.
"""
from __future__ import annotations

import json
import random
from typing import Any

from megarl.rollout.rewards.reward_registry import register_reward
from megarl.rollout.rewards.gsm8k_answer import Gsm8kReward
from megarl.rollout.tools import register_tool
from megarl.rollout.tools.calculator import CalculatorTool

Row = dict[str, Any]
"""``{"question": str, "answer": str, "expression": str}``."""

OPERATORS = ("+", "-")
CALCULATOR = "calculator"


def make_arithmetic_rows(num_rows: int, *, seed: int, min_digits: int = 3, max_digits: int = 4,
                         operators: tuple[str, ...] = OPERATORS) -> list[Row]:
    """Random problems ``a op b`` with ``min_digits``..``max_digits``-digit operands.

    Args:
        num_rows: how many rows.
        seed: RNG seed (rows are a pure function of the arguments).
        min_digits, max_digits: operand sizes, in decimal digits.
        operators: drawn uniformly from ``+``, ``-``, ``*``.

    Raises:
        ValueError: an unknown operator or an empty digit range.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    unknown = set(operators) - {"+", "-", "*"}
    if unknown:
        raise ValueError(f"unknown operators {sorted(unknown)} (known: + - *)")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = (rng.randint(10 ** (rng.randint(min_digits, max_digits) - 1),
                            10 ** max_digits - 1) for _ in range(2))
        op = rng.choice(operators)
        expression = f"{a} {op} {b}"
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        # The quotes make the expression follow the same token (` "`) in the question and in the
        # tool call's JSON, so copying it is copying the same token ids (an induction pattern).
        rows.append({"question": f'What is "{expression}"?', "answer": str(result), "expression": expression})
    return rows


def split_disjoint(rows: list[Row], num_eval: int) -> tuple[list[Row], list[Row]]:
    """Split into (train, eval) with no expression appearing in both.

    Raises:
        ValueError: fewer rows than ``num_eval``.
    """
    if num_eval > len(rows):
        raise ValueError(f"cannot hold out {num_eval} of {len(rows)} rows")
    eval_rows = rows[:num_eval]
    held = {r["expression"] for r in eval_rows}
    return [r for r in rows[num_eval:] if r["expression"] not in held], eval_rows


def demonstration(row: Row, *, use_tool: bool, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """An SFT demonstration for one row, as chat messages.

    Args:
        row: an arithmetic row.
        use_tool: True: ``calculator`` call, the tool's result, then ``\\boxed{answer}``. False: a
            direct ``\\boxed{answer}`` (the correct number: a tiny model imitating it learns the
            format but not the arithmetic, so its direct answers are mostly wrong).
        system_prompt: optional system message.
    """
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": row["question"]})
    if use_tool:
        call = {"type": "function", "function": {
            "name": CALCULATOR, "arguments": json.dumps({"expression": row["expression"]})}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": CALCULATOR, "content": row["answer"]})
    messages.append({"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"})
    return messages


def demonstrations(rows: list[Row], *, tool_fraction: float, seed: int,
                   system_prompt: str | None = None) -> list[list[dict[str, Any]]]:
    """Demonstrations for ``rows``; a seeded ``tool_fraction`` of them use the calculator.

    A warm start that uses the tool only part of the time leaves RL the choice to learn (tool
    calls mostly right, direct answers mostly wrong); on the 64-wide demo model it also halves
    the copying practice, which costs more than it gains (examples/arithmetic_tool/README.md).

    Raises:
        ValueError: ``tool_fraction`` outside [0, 1].
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    rng = random.Random(seed)
    return [demonstration(r, use_tool=rng.random() < tool_fraction, system_prompt=system_prompt)
            for r in rows]


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
