"""GSM8K (Cobbe et al. 2021, arXiv:2110.14168) as a prompt dataset.

The original rows are ``{"question": ..., "answer": "<worked solution>\\n#### 72"}``. The loader keeps
the question, puts the final number (after ``####``, thousands separators removed) in ``answer``,
and the worked solution in ``solution`` — so rewards compare against the number and SFT
demonstrations can still use the reasoning.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from megarl.data.datasets import DatasetError, PromptDataset, Row, read_rows

FINAL_ANSWER_MARK = "####"


def gsm8k_final_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####``, without commas or spaces.

    Raises:
        ValueError: the solution has no ``####`` line.
    """
    if FINAL_ANSWER_MARK not in solution:
        raise ValueError(f"GSM8K solution without a '{FINAL_ANSWER_MARK}' final answer: {solution[-80:]!r}")
    return solution.rsplit(FINAL_ANSWER_MARK, 1)[1].strip().replace(",", "").replace(" ", "")


def gsm8k_row(row: Row) -> Row:
    """One GSM8K row with ``answer`` = the final number and ``solution`` = the worked solution.

    Rows already converted (no ``####`` in ``answer``, a ``solution`` present) pass through.
    """
    answer = str(row["answer"])
    if FINAL_ANSWER_MARK not in answer:
        return dict(row)
    return {**row, "answer": gsm8k_final_answer(answer), "solution": answer}


def load_gsm8k(path: str | os.PathLike, *, max_rows: int | None = None) -> PromptDataset:
    """Load a GSM8K split (jsonl or parquet with ``question`` and ``answer`` columns).

    Args:
        path: e.g. ``.../gsm8k/train.jsonl``.
        max_rows: keep the first ``max_rows`` rows (None = all).

    Raises:
        DatasetError: unreadable file, or a row without ``question``/``answer`` or a final answer.
    """
    rows = read_rows(path)[:max_rows] if max_rows is not None else read_rows(path)
    converted = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DatasetError(f"{path}: row {i} is not a GSM8K row (needs 'question' and 'answer')")
        try:
            converted.append(gsm8k_row(row))
        except ValueError as e:
            raise DatasetError(f"{path}: row {i}: {e}") from e
    return PromptDataset(converted, prompt_key="question", answer_key="answer", path=str(path))


def is_gsm8k_file(path: str | os.PathLike) -> bool:
    """True when the first row of ``path`` looks like raw GSM8K (its answer has a ``####`` line)."""
    rows = read_rows(path)
    return bool(rows) and FINAL_ANSWER_MARK in str(rows[0].get("answer", ""))


_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def python_demonstration(row: Row, *, system_prompt: str | None = None) -> list[dict[str, Any]] | None:
    """A tool-use demonstration for one GSM8K row: compute with the ``python`` tool, then answer.

    The code prints the last calculator annotation of the worked solution (``<<48+24=72>>`` ->
    ``print(48+24)``), the tool message is what ``print`` writes, and the final turn states
    ``\\boxed{answer}``. Only the format is taught (as in ReTool's cold start); whether the policy
    picks the right computation is left to RL.

    Returns:
        The chat messages, or None when the solution has no annotation whose value is the final
        answer (about one row in ten).
    """
    from megarl.rollout.tools.calculator import calculate

    solution = str(row.get("solution") or row["answer"])
    answer = gsm8k_final_answer(solution) if FINAL_ANSWER_MARK in solution else str(row["answer"])
    found = _ANNOTATION.findall(solution)
    if not found:
        return None
    expression = found[-1][0].strip()
    try:
        value = calculate(expression)
        if abs(float(value) - float(answer)) > 1e-6:
            return None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    code = f"print({expression})"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [
        {"role": "user", "content": row["question"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": json.dumps({"code": code})}}]},
        {"role": "tool", "name": "python", "content": f"{value}\n"},
        {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
    ]
    return messages
