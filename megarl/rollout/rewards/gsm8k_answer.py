"""GSM8K final-answer correctness, judged by Hugging Face's ``math-verify`` library.

``reward = correct + format_weight * boxed`` where ``correct`` is 1.0 when math-verify finds the
policy's final answer (last ``\\boxed{}``, else the last number-like expression of its last turn)
equivalent to the reference (the number after ``####`` in the GSM8K answer), else 0.0; ``boxed`` is
1.0 when the last turn states its answer in ``\\boxed{}``.

math-verify bounds each parse/compare with ``signal.alarm``, which only works on a process's main
thread and blocks while sympy runs. With ``executor="process"`` (default) verification runs in a
small spawned worker pool, so the event loop never blocks and the timeout always works; with
``executor="inline"`` it runs in the caller (timeout only on the main thread).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from typing import TYPE_CHECKING, Any

from megarl.rollout.rewards.keys import FINAL_TEXT_KEY, GOLD_KEY, TERMS_KEY
from megarl.rollout.rewards.reward_registry import register_reward

if TYPE_CHECKING:
    from megarl.rollout.types import Trajectory

def gsm8k_reference(answer: str) -> str:
    """The reference number of a GSM8K ``answer`` field (``"... #### 1,200"`` -> ``"1200"``)."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def answers_match(response_text: str, reference: str, timeout_s: int = 5) -> bool:
    """Whether the final answer in ``response_text`` equals ``reference`` (math-verify).

    Args:
        response_text: the policy's final turn.
        reference: the reference answer (a number or LaTeX expression).
        timeout_s: math-verify's per-operation limit (used only on a main thread).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = parse(reference, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                 parsing_timeout=timeout)
    pred = parse(response_text,
                 extraction_config=[LatexExtractionConfig(boxed_match_priority=0),
                                    ExprExtractionConfig()],
                 parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


@register_reward("gsm8k")
class Gsm8kReward:
    """GSM8K correctness reward (async).

    Args:
        answer_key: dataset field with the reference answer.
        format_weight: bonus for stating the answer in ``\\boxed{}`` (0 = off).
        executor: ``process`` (spawned worker pool) or ``inline``.
        num_workers: worker processes of the pool.
        timeout_s: give up on one verification after this many seconds (reward 0).

    Raises:
        ValueError: unknown ``executor``.
    """

    def __init__(self, *, answer_key: str = "answer", format_weight: float = 0.0,
                 executor: str = "process", num_workers: int = 1, timeout_s: float = 10.0) -> None:
        if executor not in ("process", "inline"):
            raise ValueError(f"gsm8k reward: executor must be 'process' or 'inline', got {executor!r}")
        self.answer_key = answer_key
        self.format_weight = float(format_weight)
        self.executor = executor
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    async def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        """Score the trajectory's last turn against ``sample[answer_key]``.

        Raises:
            KeyError: the sample lacks ``answer_key`` or the trajectory lacks ``metadata["final_text"]``.
        """
        if self.answer_key not in sample:
            raise KeyError(f"gsm8k reward: sample has no {self.answer_key!r} field "
                           f"(fields: {sorted(sample)})")
        if FINAL_TEXT_KEY not in trajectory.metadata:
            raise KeyError(f"gsm8k reward: trajectory.metadata[{FINAL_TEXT_KEY!r}] is missing")
        text = trajectory.metadata[FINAL_TEXT_KEY]
        reference = gsm8k_reference(str(sample[self.answer_key]))
        if self.executor == "inline":
            correct = answers_match(text, reference)
        else:
            future = asyncio.get_running_loop().run_in_executor(
                self._get_pool(), answers_match, text, reference)
            try:
                correct = await asyncio.wait_for(future, self.timeout_s)
            except TimeoutError:
                correct = False
        boxed = "\\boxed{" in text
        # the terms and the gold answer, for `megarl show` (a composite reward replaces the terms with its own)
        trajectory.metadata[TERMS_KEY] = {"correct": float(correct), "boxed": self.format_weight * float(boxed)}
        trajectory.metadata[GOLD_KEY] = reference
        return float(correct) + self.format_weight * float(boxed)

    def close(self) -> None:
        """Shut the worker pool down and wait for it (queued verifications are cancelled; a running
        one ends within ``timeout_s``). Waiting matters: the pool's queues release their
        semaphores through this process's ``multiprocessing`` resource tracker, and a pool still
        tearing down when the actor is killed left the tracker gone and printed its tracebacks on
        the run's console."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
