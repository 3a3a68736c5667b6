"""The long-tail agentic task of tools/benchmarks/async_rl.py, loaded through ``plugins:``.

The arithmetic task (examples/arithmetic_tool) with a slow tool: ``longtail_calculator`` answers as
the arithmetic calculator but first waits, per question, either ``fast_s`` or, for one question in
``tail_every``, ``tail_s`` seconds (chosen by a hash of the expression, so the same prompts are slow
in every run). A few groups hold a synchronous step for their slow tool calls while the others are
done: the long tail of agentic rollouts (a search that hangs, a test suite that runs long), without
needing a model that already takes many turns.
"""
from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from megarl.plugins import import_module
from megarl.rollout.tools import register_tool

# Imported as megarl imports plugin files (one module per absolute path), so the recipe's
# sft.demonstrations (examples/arithmetic_tool/task.py:demonstrations) finds this same module and
# its tool and reward are registered once.
_arithmetic = import_module(str(Path(__file__).resolve().parents[3] / "examples/arithmetic_tool/task.py"),
                            "plugins")


def tool_delay_s(expression: str, *, fast_s: float, tail_s: float, tail_every: int) -> float:
    """The wait before answering ``expression``: ``tail_s`` for 1 in ``tail_every`` expressions."""
    digest = hashlib.blake2b(expression.replace(" ", "").encode(), digest_size=8).digest()
    return tail_s if int.from_bytes(digest, "little") % tail_every == 0 else fast_s


@register_tool("longtail_calculator")
class LongTailCalculator(_arithmetic.ArithmeticCalculator):
    """The arithmetic ``calculator`` behind a per-question latency (module docstring)."""

    def __init__(self, *, fast_s: float = 0.05, tail_s: float = 6.0, tail_every: int = 8) -> None:
        super().__init__()
        self.fast_s, self.tail_s, self.tail_every = float(fast_s), float(tail_s), int(tail_every)

    async def __call__(self, arguments: dict[str, Any]) -> str:
        expression = str(arguments.get("expression", ""))
        await asyncio.sleep(tool_delay_s(expression, fast_s=self.fast_s, tail_s=self.tail_s,
                                         tail_every=self.tail_every))
        return await super().__call__(arguments)
