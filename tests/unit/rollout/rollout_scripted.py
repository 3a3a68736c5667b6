"""A scripted engine for the agent-loop unit tests (imported by their conftest and tests).

``ScriptedEngine`` is a test double of the ``RolloutEngine`` Protocol for the agent logic only (the
real SGLang server is exercised by tests/integration/rollout): each trajectory (session) replays a
list of scripted turns, returned as the tokenizer's canonical ids of the text plus EOS, with
made-up logprobs. Integration tests check the same loop against a real server.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.rollout.types import GenerateOutput


@dataclass
class Reply:
    """One scripted turn: text, how it ends, optional delay (seconds) and engine weight version."""

    text: str
    finish: str = "stop"
    eos: bool = True
    delay_s: float = 0.0
    weight_version: str | None = None


class ScriptedEngine:
    """Replays ``script(sample_index, turn_index) -> Reply`` per session; records every call."""

    def __init__(self, tokenizer, script: Callable[[list[int], int], Reply]):
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[dict] = []
        self.turns: dict[str, int] = {}
        self._abort = asyncio.Event()
        self.paused_modes: list[str] = []
        self.routes_on_abort = True
        """An aborted turn returns its routes, as SGLang 0.5.23 does for a request aborted while running."""

    async def wait_calls(self, num_calls: int, timeout_s: float = 10.0) -> None:
        """Wait until ``generate`` has been called ``num_calls`` times (that turn is then in flight)."""
        async def called():
            while len(self.calls) < num_calls:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(called(), timeout_s)

    def logprob(self, position: int) -> float:
        return -0.01 * (position % 97) - 0.001

    @staticmethod
    def route(position: int, num_layers: int = 2, topk: int = 2) -> list[list[int]]:
        """Made-up routes ``[L, K]`` of a position, distinct per position (to check alignment)."""
        return [[(position * num_layers + layer) * topk + k for k in range(topk)] for layer in range(num_layers)]

    async def generate(self, input_ids, sampling_params, *, return_routed_experts=False,
                       session_id=None, routed_experts_start_len=0):
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        self.calls.append({"input_ids": list(input_ids), "params": dict(sampling_params),
                           "session_id": session_id})
        reply = self.script(list(input_ids), turn)
        ids = self.tokenizer.encode(reply.text, add_special_tokens=False)
        if reply.eos:
            ids.append(self.tokenizer.eos_token_id)
        finish = reply.finish
        if reply.delay_s:
            try:
                await asyncio.wait_for(self._abort.wait(), reply.delay_s)
                ids, finish = ids[:len(ids) // 2], "abort"  # aborted mid-turn: a partial turn
            except TimeoutError:
                pass
        limit = sampling_params["max_new_tokens"]
        if len(ids) > limit:
            ids, finish = ids[:limit], "length"
        start = len(input_ids)
        self.calls[-1]["routed_experts_start_len"] = routed_experts_start_len if return_routed_experts else None
        routes = None
        if return_routed_experts and (finish != "abort" or self.routes_on_abort):  # rows [start_len, P + N - 1)
            end = start + len(ids) - 1
            routes = torch.tensor([self.route(p) for p in range(routed_experts_start_len, end)],
                                  dtype=torch.int32).reshape(-1, 2, 2)
        return GenerateOutput(output_ids=ids, output_logprobs=[self.logprob(start + k) for k in range(len(ids))],
                              finish_reason=finish, cached_tokens=max(0, start - 8), routed_experts=routes,
                              weight_version=reply.weight_version, engine_id="scripted")

    async def pause(self, mode="retract"):
        self.paused_modes.append(mode)
        if mode == "abort":
            self._abort.set()
            await asyncio.sleep(0)

    async def resume(self):
        self._abort = asyncio.Event()

    async def flush_cache(self):
        pass
