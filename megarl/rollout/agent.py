"""Agent loops: one coroutine per trajectory, token ids in and token ids out (docs/architecture.md).

A loop renders the prompt with the chat template once (tool schemas included), then per turn:
generate on the engine (token ids + logprobs) -> split the turn into reasoning and answer with the
family's SGLang reasoning parser -> parse tool calls from the answer only with SGLang's
``FunctionCallParser`` detector of the family -> run the tools concurrently -> append the observation tokens and the
chat-template tokens around
them (``loss_mask`` 0, ``rollout_logprobs`` 0.0). Only the appended suffix is ever tokenised (see
:class:`~megarl.rollout.template.ChatTemplate`): the history is never re-rendered or re-tokenised, so a turn costs the
same
at 1k and 32k tokens of history, and the model's own token ids are kept exactly as sampled.

Stops, with a :class:`~megarl.rollout.types.RolloutStatus`:
``COMPLETED`` a turn ended (EOS or stop) without a tool call; ``TRUNCATED`` ``max_turns`` used up
with tool calls pending, ``max_response_tokens`` or ``max_context_tokens`` reached, or a turn ended
by length (no EOS: nothing is appended after it); ``ABORTED`` the engine aborted the request (the
partial turn is kept; :func:`run_agent` resumes it later when partial rollouts are on);
``ERROR`` the engine raised.

Registry: ``tool_agent`` (multi-turn with tools), ``single_turn`` (one generate call, no tools).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.registry import Registry
from megarl.rollout.rewards.keys import FINAL_TEXT_KEY, REASONING_TEXT_KEY
from megarl.rollout.route_parts import concat_routes
from megarl.rollout.template import ChatTemplate
from megarl.rollout.tools.calls import ToolCallParser, run_tool_calls
from megarl.rollout.tools.sessions import release_sessions, sessions_of
from megarl.rollout.trajectory_state import TrajectoryState
from megarl.rollout.types import GenerateOutput, RolloutEngine, RolloutStatus, Tool, Trajectory

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class AgentContext:
    """Everything the loops share (one per RolloutManager).

    Attributes:
        engine: where turns are generated.
        template: prompt rendering and suffix tokenisation.
        tools: tool name -> tool ({} for none).
        parser: tool-call parser for ``tools`` (None when there are none).
        sampling_params: SGLang sampling parameters of a turn (``max_new_tokens`` is the per-turn cap).
        max_turns, max_response_tokens, max_context_tokens: stop limits (AgentConfig).
        tool_timeout_s: limit of one tool call; max_tool_output_chars: observation cut.
        return_routed_experts: ask the engine for routed experts (R3).
        turn_sampling_params: extra sampling parameters per turn (see the field).
        policy_version: the current policy version (set by the manager after weight updates);
            used when the engine reports no integer ``weight_version``.
        stop_requested: end every trajectory before its next generate call (status ABORTED).
    """

    engine: RolloutEngine
    template: ChatTemplate
    tools: Mapping[str, Tool] = field(default_factory=dict)
    parser: ToolCallParser | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_response_tokens: int = 1024
    max_context_tokens: int = 4096
    tool_timeout_s: float = 30.0
    max_tool_output_chars: int = 2048
    return_routed_experts: bool = False
    policy_version: int = 0
    turn_sampling_params: Callable[[int], dict[str, Any]] | None = None
    """Extra sampling parameters for turn ``t`` (1-based), merged over ``sampling_params``; e.g. a
    ``regex`` that forces a tool call on turn 1 (warm starts, tests). Note: SGLang masks the logits
    of constrained turns before computing logprobs, so their ``rollout_logprobs`` are those of the
    constrained sampler, not of the unconstrained policy."""
    stop_requested: bool = False
    """Set by the manager to end every trajectory at its next turn boundary (status ABORTED)."""


def new_state(ctx: AgentContext, prompt_ids: list[int], sample: dict[str, Any],
              group_id: int) -> TrajectoryState:
    """A fresh trajectory for an already rendered prompt (shared by the G members of a group)."""
    return TrajectoryState(prompt_len=len(prompt_ids), ids=list(prompt_ids), sample=sample,
                           group_id=group_id, in_reasoning=ctx.template.prompt_opens_reasoning)


def _version(ctx: AgentContext, out: GenerateOutput) -> int:
    try:
        return int(out.weight_version)  # type: ignore[arg-type]  # None: TypeError, handled below
    except (TypeError, ValueError):
        return ctx.policy_version


def _turn_params(ctx: AgentContext, turn: int) -> dict[str, Any]:
    """Sampling parameters of turn ``turn`` (1-based)."""
    if ctx.turn_sampling_params is None:
        return ctx.sampling_params
    return {**ctx.sampling_params, **ctx.turn_sampling_params(turn)}


def _turn_budget(ctx: AgentContext, state: TrajectoryState, params: dict[str, Any]) -> int:
    """Tokens the next generate call may produce: per-turn, response and context limits."""
    already = state.response_len - state.turn_start  # tokens of an aborted turn being resumed
    per_turn = int(params.get("max_new_tokens", 512)) - already
    return min(per_turn, ctx.max_response_tokens - state.response_len,
               ctx.max_context_tokens - len(state.ids))


async def _generate_turn(ctx: AgentContext, state: TrajectoryState, params: dict[str, Any],
                         budget: int) -> GenerateOutput:
    """One generate call; its model tokens are appended to the state."""
    params = {**params, "max_new_tokens": budget}
    start = time.monotonic()
    kwargs: dict[str, Any] = {}
    if ctx.return_routed_experts:  # only the rows not yet stitched (module docstring of _stitch_routes)
        known = 0 if state.routed_experts is None else state.routed_experts.shape[0]
        kwargs = {"return_routed_experts": True, "routed_experts_start_len": known}
    num_input = len(state.ids)
    out = await ctx.engine.generate(state.ids, params, session_id=state.session_id, **kwargs)
    meta = state.metadata
    meta["generate_time_s"] += time.monotonic() - start
    meta["num_generate_calls"] += 1
    meta["input_tokens"] += len(state.ids)
    meta["cached_tokens"] += out.cached_tokens
    meta["finish_reasons"].append(out.finish_reason)
    meta["generated_tokens"] += len(out.output_ids)
    if out.engine_id is not None:
        meta["engine_id"] = out.engine_id
    if len(out.output_ids) != len(out.output_logprobs):
        raise ValueError(f"engine returned {len(out.output_ids)} ids but "
                         f"{len(out.output_logprobs)} logprobs")
    if ctx.return_routed_experts:
        _stitch_routes(state, out, num_input)
    state.append(list(out.output_ids), model=True, logprobs=[float(x) for x in out.output_logprobs],
                 version=_version(ctx, out))
    return out


def _stitch_routes(state: TrajectoryState, out: GenerateOutput, num_input: int) -> None:
    """Append one turn's routed experts (R3) to ``state.routed_experts``.

    What route each token gets: the route of position ``t`` is the expert choice of the engine's
    forward pass that read token ``t`` as input (SGLang returns rows ``[start, P + N - 1)`` of a call
    with ``P`` input and ``N`` output tokens). So prompt tokens get the first turn's prefill routes;
    a model token gets the routes of the decode step that consumed it, except the last token of a
    turn, which no forward of that turn read: its route, and the routes of the tool-output and
    chat-template tokens appended after the turn, come from the next turn's prefill (the engine
    computed them there, exactly as for prompt tokens). Each call asks only for the rows from the
    first unknown position on (``routed_experts_start_len``), so routes already stitched are never
    re-sent, and a prefix-cache hit returns the rows captured when the cached tokens were computed.
    The trajectory's final token is read by no forward at all: it stays -1 (the trainer routes it
    freely; its routing affects no trained logprob, which depends on positions before it only).

    Across a weight update (``weight_sync.pause_mode: abort``, or the manager's abort of over-sampled
    requests with ``rollout.partial_rollouts``): SGLang 0.5.23 ends a running request it aborts after
    one more forward and collects its routes like a finished one's (``Scheduler.abort_request`` sets
    ``to_finish``; ``BatchResultProcessor._maybe_collect_routed_experts``), so the aborted turn's rows
    are those its old-weight forwards chose, and they are kept. The resumed turn is a new request:
    its prefill recomputes the whole prefix under the new weights, but it is asked only for the rows
    from the first unknown position on, i.e. the last token sampled before the pause (which that
    prefill reads first) and what follows. So every row is the route of the forward that sampled
    the next token. (``retract`` cannot keep them: it frees the request's KV slots, whose indices
    the capture buffer is keyed by, and reports the re-prefill's routes when the request finishes;
    ``megarl validate`` refuses it with R3 in async mode, see ``megarl.config.validate.CONFLICTS``.)

    Args:
        state: the trajectory; ``routed_experts`` ``[rows, L, K]`` grows to ``num_input + N - 1`` rows.
        out: the turn's output; ``routed_experts`` ``[num_input + N - 1 - rows, L, K]`` (a tensor, or
            a :class:`~megarl.rollout.route_parts.RoutePart` kept by an engine-facing worker), or None
            for a request aborted before it ran (it produced no token: the resumed turn asks for
            the same rows again).
        num_input: tokens sent to the engine in this call.

    Raises:
        ValueError: the engine returned no routes for a turn that produced tokens, or a row count
            other than the one asked for.
    """
    known = 0 if state.routed_experts is None else state.routed_experts.shape[0]
    routes = out.routed_experts
    aborted = out.finish_reason == "abort"
    if aborted and not out.output_ids:
        # Nothing was sampled from these rows (if any): the resumed turn's prefill, which samples
        # the next token, computes them again under the weights it runs with.
        return
    if routes is None:
        if aborted:
            raise ValueError(f"the engine aborted a turn after {len(out.output_ids)} tokens without their "
                             "routed_experts (R3): their sampling-time routes are lost")
        raise ValueError("the engine returned no routed_experts (R3); launch it with --enable-return-routed-experts")
    expected = max(0, num_input + len(out.output_ids) - 1 - known)
    if routes.shape[0] != expected:
        raise ValueError(f"the engine returned {routes.shape[0]} routed_experts rows, expected {expected} "
                         f"(positions [{known}, {num_input + len(out.output_ids) - 1}))")
    state.routed_experts = concat_routes(state.routed_experts, routes.to(torch.int32))  # tensors, or parts


def _read_turn(ctx: AgentContext, state: TrajectoryState, turn_ids: list[int]) -> None:
    """Record the turn's answer (``final_text``: what tool calls and rewards read) and reasoning."""
    reasoning, answer = ctx.template.split_turn(ctx.template.decode(turn_ids), in_reasoning=state.in_reasoning)
    state.metadata[FINAL_TEXT_KEY] = answer
    state.metadata[REASONING_TEXT_KEY] = reasoning


async def _run_tools(ctx: AgentContext, state: TrajectoryState, calls: list) -> str:
    """Run the turn's tool calls concurrently; the text to append (observations + template)."""
    start = time.monotonic()
    results = await run_tool_calls(calls, sessions_of(state).bind(ctx.tools), timeout_s=ctx.tool_timeout_s,
                                   max_output_chars=ctx.max_tool_output_chars)
    meta = state.metadata
    meta["tool_time_s"] += time.monotonic() - start
    meta["tool_calls"] += len(results)
    meta["tool_errors"] += sum(r.is_error for r in results)
    end_token = state.ids[-1] if state.turn_ended_with_eos else None
    return ctx.template.observation_text([r.text for r in results], end_token)


async def tool_agent(ctx: AgentContext, state: TrajectoryState) -> None:
    """Multi-turn tool-calling loop; advances ``state`` until it has a status.

    Resumable at any point: a cancelled or aborted run continues from the state (an unfinished
    model turn is continued; a finished turn whose tools had not run gets them run).
    """
    while True:
        if state.pending_tools:
            calls = ctx.parser.parse(state.metadata[FINAL_TEXT_KEY]) if ctx.parser else []
            if not calls:
                state.status = RolloutStatus.COMPLETED
                return
            if state.num_turns >= ctx.max_turns:  # calls left unanswered: no turn to read them
                state.status = RolloutStatus.TRUNCATED
                return
            suffix_text = await _run_tools(ctx, state, calls)
            suffix = ctx.template.encode(suffix_text)
            if (state.response_len + len(suffix) >= ctx.max_response_tokens
                    or len(state.ids) + len(suffix) >= ctx.max_context_tokens):
                state.status = RolloutStatus.TRUNCATED  # no room for another model turn after it
                return
            state.append(suffix, model=False, version=state.versions[-1])
            state.in_reasoning = ctx.template.reasoning is not None and ctx.template.reasoning.leaves_open(suffix_text)
            state.turn_start = state.response_len
            state.pending_tools = False
        if ctx.stop_requested:
            state.status = RolloutStatus.ABORTED
            return
        resuming = state.response_len > state.turn_start
        if not resuming and state.num_turns >= ctx.max_turns:
            state.status = RolloutStatus.TRUNCATED
            return
        turn = state.num_turns if resuming else state.num_turns + 1
        params = _turn_params(ctx, turn)
        budget = _turn_budget(ctx, state, params)
        if budget <= 0:
            state.status = RolloutStatus.TRUNCATED
            return
        out = await _generate_turn(ctx, state, params, budget)
        state.num_turns = turn  # after the call: a cancelled call leaves the state as it was
        if out.finish_reason == "abort":
            state.status = RolloutStatus.ABORTED
            return
        turn_ids = state.ids[state.prompt_len + state.turn_start:]
        _read_turn(ctx, state, turn_ids)
        if out.finish_reason == "length":  # no EOS: the turn is cut, nothing may follow it
            state.status = RolloutStatus.TRUNCATED
            return
        state.turn_ended_with_eos = bool(turn_ids) and turn_ids[-1] in ctx.template.eos_token_ids
        state.pending_tools = True


async def single_turn(ctx: AgentContext, state: TrajectoryState) -> None:
    """One generate call (resumed after an abort), no tools."""
    if ctx.stop_requested:
        state.status = RolloutStatus.ABORTED
        return
    params = _turn_params(ctx, 1)
    budget = _turn_budget(ctx, state, params)
    if budget <= 0:
        state.status = RolloutStatus.TRUNCATED
        return
    state.num_turns = 1
    out = await _generate_turn(ctx, state, params, budget)
    _read_turn(ctx, state, state.ids[state.prompt_len:])
    state.status = {"abort": RolloutStatus.ABORTED, "length": RolloutStatus.TRUNCATED}.get(
        out.finish_reason, RolloutStatus.COMPLETED)


AgentLoop = Callable[[AgentContext, TrajectoryState], Awaitable[None]]
AGENT_REGISTRY: Registry[AgentLoop] = Registry("agent loop", "rollout.agent.name",
                                          [("tool_agent", tool_agent), ("single_turn", single_turn)])
"""``rollout.agent.name`` -> agent loop coroutine function."""


def register_agent(name: str) -> Callable[[AgentLoop], AgentLoop]:
    """Decorator adding an agent loop (``async def loop(ctx, state)``) to :data:`AGENT_REGISTRY`.

    Raises:
        ValueError: ``name`` is already registered to another loop.
    """
    return AGENT_REGISTRY.register(name)


def get_agent_loop(name: str) -> AgentLoop:
    """The agent loop registered as ``name``, or named by an import path (``my_pkg.agents:loop``).

    Raises:
        ValueError: unknown name or unloadable import path (:class:`megarl.plugins.PluginError`).
    """
    return AGENT_REGISTRY.resolve(name)


async def run_agent(loop: AgentLoop, ctx: AgentContext, state: TrajectoryState) -> Trajectory:
    """Run (or resume) ``state`` to a status and return its trajectory; engine errors -> ERROR.

    A state that already finished (completed, truncated, error) is returned as it is.
    """
    if state.status not in (None, RolloutStatus.ABORTED):
        return state.to_trajectory()
    state.status = None
    meta = state.metadata
    start, waited = time.monotonic(), meta["generate_time_s"] + meta["tool_time_s"]
    try:
        await loop(ctx, state)
    except Exception as e:  # noqa: BLE001 - one failed trajectory must not sink the batch
        logger.warning("trajectory %s failed: %s: %s", state.session_id, type(e).__name__, e)
        state.status = RolloutStatus.ERROR
        meta["error"] = f"{type(e).__name__}: {e}"
    finally:
        await release_sessions(state)  # stateful tools: released however the trajectory ended
        end_session = getattr(ctx.engine, "end_session", None)  # router affinity bookkeeping
        if end_session is not None and state.status is not RolloutStatus.ABORTED:
            end_session(state.session_id)
        # Agent-loop time outside the engine and the tools: decoding, parsing, suffix tokenisation.
        meta["orchestration_s"] += (time.monotonic() - start
                                    - (meta["generate_time_s"] + meta["tool_time_s"] - waited))
    return state.to_trajectory()
