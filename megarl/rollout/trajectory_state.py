"""A trajectory under construction by an agent loop (:class:`TrajectoryState`), frozen into a
:class:`~megarl.rollout.types.Trajectory` when the loop ends."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.rollout.rewards.keys import FINAL_TEXT_KEY, REASONING_TEXT_KEY
from megarl.rollout.route_parts import RouteParts
from megarl.rollout.types import RolloutStatus, Trajectory


@dataclass(kw_only=True)
class TrajectoryState:
    """A trajectory under construction; survives an abort so the rollout can be resumed.

    ``ids`` is prompt + response in one list that only grows (passed to the engine uncopied).
    """

    prompt_len: int
    ids: list[int]
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0
    """Index into the response where the current (possibly aborted) model turn began."""
    num_turns: int = 0
    pending_tools: bool = False
    """The last model turn finished (stop) and its tool calls have not been run yet."""
    turn_ended_with_eos: bool = False
    in_reasoning: bool = False
    """The current model turn starts inside a reasoning block the appended text opened."""
    status: RolloutStatus | None = None
    group_id: int = 0
    sample: dict[str, Any] = field(default_factory=dict)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    routed_experts: torch.Tensor | RouteParts | None = None
    tool_sessions: Any = None
    """Sessions of the stateful tools this trajectory called (:mod:`megarl.rollout.tools.sessions`)."""
    """``[rows, L, K]`` int32 engine routes of positions ``[0, rows)`` of ``ids`` (R3), stitched
    turn by turn by :func:`megarl.rollout.agent._stitch_routes`; None until the first turn returns routes."""
    metadata: dict[str, Any] = field(default_factory=lambda: {
        "tool_calls": 0, "tool_errors": 0, "tool_time_s": 0.0, "generate_time_s": 0.0,
        "orchestration_s": 0.0, "input_tokens": 0, "cached_tokens": 0, "finish_reasons": [],
        "num_generate_calls": 0, "generated_tokens": 0, FINAL_TEXT_KEY: "", REASONING_TEXT_KEY: ""})

    @property
    def response_len(self) -> int:
        """Tokens after the prompt (model and agent tokens): ``len(ids) - prompt_len``."""
        return len(self.ids) - self.prompt_len

    def append(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None,
               version: int) -> None:
        """Append model tokens (loss_mask 1, engine logprobs) or agent tokens (0, 0.0)."""
        self.ids.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        if model and logprobs is None:
            raise ValueError("append(model=True) needs the engine's logprobs of the tokens")
        self.logprobs.extend(logprobs if model and logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version] * len(ids))

    def to_trajectory(self) -> Trajectory:
        """Freeze into a :class:`Trajectory` (tensors of the response)."""
        model_versions = {v for v, m in zip(self.versions, self.loss_mask) if m}
        first_version = self.versions[self.loss_mask.index(1)] if model_versions else 0
        return Trajectory(
            prompt_ids=torch.tensor(self.ids[:self.prompt_len], dtype=torch.int64),
            response_ids=torch.tensor(self.ids[self.prompt_len:], dtype=torch.int64),
            loss_mask=torch.tensor(self.loss_mask, dtype=torch.int64),
            rollout_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            status=self.status or RolloutStatus.ERROR, num_turns=self.num_turns,
            policy_version=first_version,
            routed_experts=self._response_routes(),  # type: ignore[arg-type]  # or RouteParts, assembled by launch
            group_id=self.group_id, sample=self.sample, metadata=dict(self.metadata),
            token_policy_versions=(torch.tensor(self.versions, dtype=torch.int32)
                                   if len(model_versions) > 1 else None))

    def _response_routes(self) -> torch.Tensor | RouteParts | None:
        """``[P + R, L, K]`` routes of every position; -1 rows where the engine ran no forward on
        the token (the trajectory's last token, see :func:`megarl.rollout.agent._stitch_routes`)."""
        if self.routed_experts is None:
            return None
        routes = self.routed_experts
        if isinstance(routes, RouteParts):  # kept in the object store: cut / padded where assembled
            return routes.with_length(len(self.ids))
        out = torch.full((len(self.ids), *routes.shape[1:]), -1, dtype=torch.int32)
        known = routes[:len(self.ids)]
        out[:known.shape[0]] = known.to(torch.int32)
        return out
