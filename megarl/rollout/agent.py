"""Agent loops: one coroutine per trajectory, token ids in and token ids out (docs/architecture.md).

A loop renders the prompt with the chat template once (tool schemas included), then per turn:
generate on the engine (token ids + logprobs) -> split the turn into reasoning and answer with the
family's SGLang reasoning parser -> parse tool calls from the answer only with SGLang's
``FunctionCallParser`` detector of the family -> run the tools concurrently -> append the observation tokens and the chat-template tokens around
them (``loss_mask`` 0, ``rollout_logprobs`` 0.0). Only the appended suffix is ever tokenised (see
:class:`ChatTemplate`): the history is never re-rendered or re-tokenised, so a turn costs the same
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

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import torch

from megarl.registry import registrar
from megarl.rollout.reasoning import ReasoningFormat, resolve_parsers
from megarl.rollout.rewards.keys import FINAL_TEXT_KEY, REASONING_TEXT_KEY
from megarl.rollout.tools.calls import ToolCallParser, run_tool_calls
from megarl.rollout.tools.sessions import release_sessions, sessions_of
from megarl.rollout.types import GenerateOutput, RolloutEngine, RolloutStatus, Tool, Trajectory

logger = logging.getLogger(__name__)

_SENTINEL = "\u2063megarl-end-of-model-turn\u2063"


def _stop_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and the ``eos_token_id`` list of ``generation_config.json`` beside it (the
    ids SGLang stops on)."""
    ids = {tokenizer.eos_token_id}
    try:
        config = json.loads((Path(str(tokenizer.name_or_path)) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return ids
    eos = config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


class ChatTemplate:
    """Renders prompts once and tokenises only what the agent loop appends between turns.

    The tokens that follow a model turn (end-of-turn marker if the model did not emit it, the tool
    messages wrapped by the template, the next ``assistant`` header) are found by rendering a fixed
    two-message anchor conversation whose assistant content is a sentinel, plus the new tool
    messages, and taking the text after the sentinel. Its cost depends on the observations only.

    Every turn is split into reasoning and answer by ``reasoning`` (the family's SGLang reasoning
    parser): tool calls and the final answer are read from the answer only.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tool_schemas: OpenAI-style schemas rendered into the system prompt ([] for no tools).
        system_prompt: optional system message.
        eos_token_ids: ids that end an assistant turn (default: the tokenizer's EOS and the
            ``eos_token_id`` of the model's ``generation_config.json``, e.g. GLM-4.5's
            ``<|observation|>`` and ``<|user|>``).
        chat_template_kwargs: passed to every render (e.g. ``{"enable_thinking": False}``): the
            prompt, each observation suffix and its generation prompt.
        reasoning: the family's reasoning format (None: no reasoning separation).

    Raises:
        ValueError: the template does not render the anchor's assistant content verbatim.
    """

    def __init__(self, tokenizer: Any, tool_schemas: list[dict[str, Any]],
                 system_prompt: str | None = None, eos_token_ids: set[int] | None = None, *,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 reasoning: ReasoningFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_schemas = tool_schemas or None
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.reasoning = reasoning
        self.eos_token_ids = set(eos_token_ids or _stop_token_ids(tokenizer))
        self._anchor = [{"role": "user", "content": "?"},
                        {"role": "assistant", "content": _SENTINEL}]
        if _SENTINEL not in self.render(self._anchor):
            raise ValueError("chat template does not render assistant content verbatim; "
                             "incremental tokenisation needs it")
        # The generation prompt alone (text after the last user message), e.g. Qwen3's
        # "<|im_start|>assistant\n" or DeepSeek-R1's "<｜Assistant｜><think>\n".
        gen = self.render([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True)
        self.generation_prompt = gen[gen.rindex(_SENTINEL) + len(_SENTINEL):]
        self.prompt_opens_reasoning = bool(reasoning) and reasoning.leaves_open(self.generation_prompt)
        """The first model turn starts inside reasoning (the generation prompt opened it)."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (with the system prompt, tool schemas and
        ``chat_template_kwargs``)."""
        if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tool_schemas, add_generation_prompt=add_generation_prompt,
            tokenize=False, **self.chat_template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; special-token strings become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the prompt once, ending with the assistant header."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_text(self, observations: list[str], end_token_id: int | None) -> str:
        """Text appended after a model turn: tool messages and the next generation prompt.

        Args:
            observations: the tool results of the turn, in call order.
            end_token_id: the EOS the model ended its turn with (None: it ended without one). When
                the template's text after the turn starts with that token (Qwen's ``<|im_end|>``,
                GLM-4.5's ``<|observation|>``), it is already in the ids and is not appended again.
        """
        tool_messages = [{"role": "tool", "content": text} for text in observations]
        rendered = self.render(self._anchor + tool_messages, add_generation_prompt=True)
        suffix = rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]
        end_text = self.tokenizer.decode([end_token_id]) if end_token_id is not None else ""
        if end_text and suffix.startswith(end_text):
            suffix = suffix[len(end_text):]
        return suffix

    def observation_ids(self, observations: list[str], end_token_id: int | None) -> list[int]:
        """Token ids of :meth:`observation_text`."""
        return self.encode(self.observation_text(observations, end_token_id))

    def split_turn(self, text: str, *, in_reasoning: bool) -> tuple[str, str]:
        """``(reasoning, answer)`` of a decoded model turn (``("", text)`` without a reasoning format)."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, in_reasoning=in_reasoning)

    def decode(self, ids: list[int]) -> str:
        """Text of model tokens, special tokens kept (``<tool_call>`` may be one), EOS dropped."""
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def build_template(tokenizer: Any, agent: Any, tools: Mapping[str, Tool],
                   eos_token_ids: set[int] | None = None) -> tuple[ChatTemplate, ToolCallParser | None]:
    """The chat template and tool-call parser of ``rollout.agent`` (an ``AgentConfig``) for a model.

    ``reasoning_parser`` / ``tool_call_parser`` ``auto`` resolve from the model family
    (:func:`megarl.rollout.reasoning.resolve_parsers`); ``chat_template_kwargs`` go to every render.

    Raises:
        ValueError: a parser name SGLang does not know, or ``auto`` for an unknown family.
    """
    from omegaconf import OmegaConf

    reasoning, tool_parser = resolve_parsers(tokenizer, getattr(agent, "reasoning_parser", "auto"),
                                             getattr(agent, "tool_call_parser", "auto"))
    kwargs = getattr(agent, "chat_template_kwargs", None) or {}
    kwargs = OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else dict(kwargs)
    template = ChatTemplate(tokenizer, [t.schema for t in tools.values()], agent.system_prompt,
                            eos_token_ids, chat_template_kwargs=kwargs,
                            reasoning=ReasoningFormat(reasoning) if reasoning else None)
    return template, (ToolCallParser(tools, tool_parser) if tools else None)


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
    routed_experts: torch.Tensor | None = None
    tool_sessions: Any = None
    """Sessions of the stateful tools this trajectory called (:mod:`megarl.rollout.tools.sessions`)."""
    """``[rows, L, K]`` int32 engine routes of positions ``[0, rows)`` of ``ids`` (R3), stitched
    turn by turn by :func:`_stitch_routes`; None until the first turn returns routes."""
    metadata: dict[str, Any] = field(default_factory=lambda: {
        "tool_calls": 0, "tool_errors": 0, "tool_time_s": 0.0, "generate_time_s": 0.0,
        "orchestration_s": 0.0, "input_tokens": 0, "cached_tokens": 0, "finish_reasons": [],
        "num_generate_calls": 0, "generated_tokens": 0, FINAL_TEXT_KEY: "", REASONING_TEXT_KEY: ""})

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def append(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None,
               version: int) -> None:
        """Append model tokens (loss_mask 1, engine logprobs) or agent tokens (0, 0.0)."""
        self.ids.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        self.logprobs.extend(logprobs if model else [0.0] * len(ids))
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
            policy_version=first_version, routed_experts=self._response_routes(),
            group_id=self.group_id, sample=self.sample, metadata=dict(self.metadata),
            token_policy_versions=(torch.tensor(self.versions, dtype=torch.int32)
                                   if len(model_versions) > 1 else None))

    def _response_routes(self) -> torch.Tensor | None:
        """``[P + R, L, K]`` routes of every position; -1 rows where the engine ran no forward on
        the token (the trajectory's last token, see :func:`_stitch_routes`)."""
        if self.routed_experts is None:
            return None
        routes = self.routed_experts
        out = torch.full((len(self.ids), *routes.shape[1:]), -1, dtype=torch.int32)
        known = routes[:len(self.ids)]
        out[:known.shape[0]] = known.to(torch.int32)
        return out


def new_state(ctx: AgentContext, prompt_ids: list[int], sample: dict[str, Any],
              group_id: int) -> TrajectoryState:
    """A fresh trajectory for an already rendered prompt (shared by the G members of a group)."""
    return TrajectoryState(prompt_len=len(prompt_ids), ids=list(prompt_ids), sample=sample,
                           group_id=group_id, in_reasoning=ctx.template.prompt_opens_reasoning)


def _version(ctx: AgentContext, out: GenerateOutput) -> int:
    try:
        return int(out.weight_version)
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
    kwargs = {}
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

    Args:
        state: the trajectory; ``routed_experts`` ``[rows, L, K]`` grows to ``num_input + N - 1`` rows.
        out: the turn's output; ``routed_experts`` ``[num_input + N - 1 - rows, L, K]``, or None when
            the request was aborted (SGLang collects routes of finished requests only; the resumed
            turn asks for the same rows again).
        num_input: tokens sent to the engine in this call.

    Raises:
        ValueError: the engine returned no routes for a finished turn, or a row count other than
            the one asked for.
    """
    known = 0 if state.routed_experts is None else state.routed_experts.shape[0]
    routes = out.routed_experts
    if routes is None:
        if out.finish_reason == "abort":
            return
        raise ValueError("the engine returned no routed_experts (R3); launch it with --enable-return-routed-experts")
    expected = max(0, num_input + len(out.output_ids) - 1 - known)
    if routes.shape[0] != expected:
        raise ValueError(f"the engine returned {routes.shape[0]} routed_experts rows, expected {expected} "
                         f"(positions [{known}, {num_input + len(out.output_ids) - 1}))")
    routes = routes.to(torch.int32)
    state.routed_experts = routes if state.routed_experts is None else torch.cat([state.routed_experts, routes])


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
            state.in_reasoning = bool(ctx.template.reasoning) and ctx.template.reasoning.leaves_open(suffix_text)
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
        turn = state.ids[state.prompt_len + state.turn_start:]
        _read_turn(ctx, state, turn)
        if out.finish_reason == "length":  # no EOS: the turn is cut, nothing may follow it
            state.status = RolloutStatus.TRUNCATED
            return
        state.turn_ended_with_eos = bool(turn) and turn[-1] in ctx.template.eos_token_ids
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
AGENT_REGISTRY: dict[str, AgentLoop] = {"tool_agent": tool_agent, "single_turn": single_turn}
"""``rollout.agent.name`` -> agent loop coroutine function."""


def register_agent(name: str) -> Callable[[AgentLoop], AgentLoop]:
    """Decorator adding an agent loop (``async def loop(ctx, state)``) to :data:`AGENT_REGISTRY`.

    Raises:
        ValueError: ``name`` is already registered to another loop.
    """
    return registrar(AGENT_REGISTRY, name, "agent loop")


def get_agent_loop(name: str) -> AgentLoop:
    """The agent loop registered as ``name``, or named by an import path (``my_pkg.agents:loop``).

    Raises:
        ValueError: unknown name or unloadable import path (:class:`megarl.plugins.PluginError`).
    """
    from megarl.plugins import resolve

    return resolve(name, AGENT_REGISTRY, key="rollout.agent.name", kind="agent loop")


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
