"""Supervised demonstrations (SFT cold start) tokenised the way rollouts are.

A demonstration is a list of chat messages (system, user, assistant with ``tool_calls``, tool,
assistant, ...). It becomes a :class:`~megarl.rollout.types.Trajectory` built turn by turn exactly as
the agent loop builds a rollout, with the same :class:`~megarl.rollout.template.ChatTemplate` (and so the
same ``chat_template_kwargs``): the prompt rendered once with the generation prompt; per assistant
message the text the model would generate after what precedes it, and the end-of-turn token it
stops on (``loss_mask`` 1); after it the template's tool messages and next generation prompt,
rendered as the loop renders them (:meth:`ChatTemplate.observation_text`, ``loss_mask`` 0). The
history is never re-rendered, so templates that re-render earlier turns differently (Qwen3,
DeepSeek-R1) work, and the SFT'd policy sees exactly the token boundaries it meets in RL.

What the model generates for an assistant message is the template's own rendering of that message as
the newest turn, minus the generation prompt before it and the template text after it. Reasoning
(``reasoning_content``, or ``<think>...</think>`` in ``content``) is trained as the template writes
it; a template that writes an empty think block for a turn without reasoning (Qwen3 and GLM-4.5
with thinking on) trains that block, as the model emits it when answering without thinking (with
``enable_thinking: false`` the block is in the generation prompt instead and is not trained). When
the generation prompt itself opens the reasoning (DeepSeek-R1's ``<think>\n``) the turn is the
reasoning, ``\n</think>\n\n``, then the rendered answer.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megarl.registry import Registry
from megarl.rollout.types import RolloutStatus, Trajectory

_ANCHOR = "\u2063megarl-demonstration-anchor\u2063"


class DemonstrationError(ValueError):
    """A demonstration cannot be laid out as the agent loop lays out a rollout."""


def _with_other_argument_form(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with tool-call arguments switched between JSON string and object (GLM-4.5's
    template needs objects, DeepSeek-R1's strings)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = dict(call.get("function", call))
        args = fn.get("arguments")
        fn["arguments"] = json.loads(args) if isinstance(args, str) else json.dumps(args)
        calls.append({**call, "function": fn} if "function" in call else fn)
    return {**message, "tool_calls": calls}


def _render_after(template: Any, context: list[dict[str, Any]], message: dict[str, Any]) -> str:
    """The template's text of ``context + [message]`` after the anchor (arguments form retried)."""
    try:
        text = template.render(context + [message])
    except Exception as first:  # jinja raises TypeError / UndefinedError / TemplateError
        if not message.get("tool_calls"):
            raise DemonstrationError(f"the chat template cannot render {message!r}: {first}") from first
        try:
            text = template.render(context + [_with_other_argument_form(message)])
        except Exception:  # noqa: BLE001
            raise DemonstrationError(f"the chat template cannot render {message!r}: {first}") from first
    return text[text.rindex(_ANCHOR) + len(_ANCHOR):]


def _reasoning_of(message: Mapping[str, Any], think_end: str) -> str:
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"].strip()
    content = message.get("content") or ""
    return content.split(think_end)[0].split("<think>")[-1].strip() if think_end in content else ""


def _after_anchor(template: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    return text[text.rindex(_ANCHOR) + len(_ANCHOR):]


def _model_turn(template: Any, context: list[dict[str, Any]], message: dict[str, Any],
                observations: list[str], k: int) -> tuple[str, int]:
    """The text the model generates for assistant ``message`` and the end-of-turn id it stops on.

    Args:
        template: the rollout's chat template.
        context: messages standing for what precedes the turn, the last holding the anchor: the
            prompt (a user turn) or, after tool output, an assistant turn and its tool messages.
        message: the demonstrated assistant message.
        observations: the tool messages that answer it ([] for the final turn).
        k: the message's index (for errors).
    """
    generation_prompt = _after_anchor(template, context, add_generation_prompt=True)
    body = _render_after(template, context, message)
    anchor_turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANCHOR}]
    tail = _after_anchor(template, anchor_turn)  # template text after an assistant turn
    if tail and not body.endswith(tail):
        raise DemonstrationError(f"message {k}: the template does not end an assistant turn with {tail!r}")
    body = body[:len(body) - len(tail)]
    reasoning = template.reasoning
    if body.startswith(generation_prompt):
        text = body[len(generation_prompt):]
    elif (reasoning is not None and reasoning.leaves_open(generation_prompt)
          and body.startswith(head := generation_prompt[:generation_prompt.rindex(reasoning.think_start)])):
        # The prompt opened the reasoning (DeepSeek-R1) and the template renders turns without it.
        thought = _reasoning_of(message, reasoning.think_end)
        answer = body[len(head):]
        answer = answer.split(reasoning.think_end)[-1] if reasoning.think_end in answer else answer
        text = (thought + "\n" if thought else "\n") + reasoning.think_end + "\n\n" + answer.lstrip("\n")
    else:
        raise DemonstrationError(
            f"message {k}: the chat template renders this assistant message so that it does not follow "
            f"its own generation prompt {generation_prompt!r} (e.g. reasoning with thinking off, or a "
            "template that writes tool calls after tool output under another header)")
    # The end-of-turn token: the stop token the template writes right after the turn (Qwen's
    # <|im_end|>, DeepSeek's EOS, GLM-4.5's <|observation|> before tool output and <|user|> after).
    following = _after_anchor(template, anchor_turn + ([{"role": "tool", "content": o} for o in observations]
                                                       or [{"role": "user", "content": "?"}]))
    for token_id in sorted(template.eos_token_ids):
        end_text = template.tokenizer.decode([token_id])
        if end_text and following.startswith(end_text):
            return text, token_id
    raise DemonstrationError(f"message {k}: no end-of-turn token starts {following[:40]!r}")


def demonstration_to_trajectory(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                                tools: Sequence[dict] | None = None,
                                chat_template_kwargs: Mapping[str, Any] | None = None,
                                template: Any = None, group_id: int = 0) -> Trajectory:
    """Tokenise one demonstration into a trajectory laid out as the agent loop lays out rollouts.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: chat messages: a prompt (system, user), then assistant turns, each followed by the
            tool messages answering it (the agent loop appends nothing else between turns).
        tools: OpenAI-style tool schemas rendered into the system prompt (as in rollouts).
        chat_template_kwargs: passed to every render (``rollout.agent.chat_template_kwargs``).
        template: the rollout's :class:`~megarl.rollout.template.ChatTemplate` (default: one built from
            the arguments above, with the model family's reasoning format).
        group_id: stored on the trajectory.

    Returns:
        A trajectory: ``prompt_ids [P]``, ``response_ids [R]``, ``loss_mask [R]`` (1 on the tokens the
        model generates, end-of-turn tokens included), ``rollout_logprobs [R]`` zeros,
        ``metadata["sft"] = True``.

    Raises:
        DemonstrationError: no assistant message, a user/system message after the first assistant
            message, two assistant messages without tool messages between them, or a message the
            template cannot lay out turn by turn (the message names its index).
    """
    if template is None:
        template = _default_template(tokenizer, tools, chat_template_kwargs)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DemonstrationError("a demonstration needs at least one assistant message")
    first = roles.index("assistant")
    prompt_ids = template.prompt_ids(list(messages[:first]))
    context = [{"role": "user", "content": _ANCHOR}]
    response: list[int] = []
    mask: list[int] = []
    k = first
    while k < len(messages):
        j, observations = _tool_messages_after(messages, roles, k)
        text, end_id = _model_turn(template, context, dict(messages[k]), observations, k)
        ids = template.encode(text) + [end_id]
        response += ids
        mask += [1] * len(ids)
        if observations:  # appended exactly as the agent loop appends them
            ids = template.observation_ids(observations, end_id)
            response += ids
            mask += [0] * len(ids)
            context = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANCHOR},
                       *({"role": "tool", "content": o} for o in observations)]
        k = j
    return Trajectory(
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_ids=torch.tensor(response, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.int64),
        rollout_logprobs=torch.zeros(len(response), dtype=torch.float32),
        status=RolloutStatus.COMPLETED, num_turns=roles.count("assistant"), group_id=group_id,
        metadata={"sft": True})


def _default_template(tokenizer: Any, tools: Sequence[dict] | None,
                      chat_template_kwargs: Mapping[str, Any] | None) -> Any:
    """A :class:`~megarl.rollout.template.ChatTemplate` from the arguments of
    :func:`demonstration_to_trajectory`, with the model family's reasoning format."""
    from megarl.models.families import find_family
    from megarl.rollout.reasoning import ReasoningFormat, model_type_of
    from megarl.rollout.template import ChatTemplate

    family = find_family(model_type_of(tokenizer))
    reasoning = family.reasoning_parser if family else None
    return ChatTemplate(tokenizer, list(tools or []), chat_template_kwargs=chat_template_kwargs,
                        reasoning=ReasoningFormat(reasoning) if reasoning else None)


def _tool_messages_after(messages: Sequence[dict[str, Any]], roles: list[str], k: int) -> tuple[int, list[str]]:
    """``(j, observations)``: the tool messages answering assistant message ``k`` are ``k + 1 .. j - 1``
    (``j``: the next assistant message, or the end), ``observations`` their contents.

    Raises:
        DemonstrationError: a user/system message follows, or the next assistant message has no
            tool messages before it.
    """
    j = k + 1
    while j < len(messages) and roles[j] == "tool":
        j += 1
    observations = [str(m["content"]) for m in messages[k + 1:j]]
    if j < len(messages) and roles[j] != "assistant":
        raise DemonstrationError(f"message {j}: a {roles[j]} message after the first assistant message "
                                 "(the agent loop appends only tool messages between model turns)")
    if j < len(messages) and not observations:
        raise DemonstrationError(f"message {j}: two assistant messages without tool messages between them")
    return j, observations


def _gsm8k_python(rows: Sequence[dict], *, system_prompt: str | None, tool_fraction: float,
                  seed: int) -> list[list[dict[str, Any]]]:
    from megarl.data.gsm8k import python_demonstration

    demos = [python_demonstration(r, system_prompt=system_prompt) for r in rows]
    return [d for d in demos if d is not None]


DemonstrationBuilder = Callable[..., list[list[dict[str, Any]]]]
"""``builder(rows, *, system_prompt, tool_fraction, seed) -> demonstrations`` (lists of chat messages)."""

DEMONSTRATION_BUILDERS: Registry[DemonstrationBuilder] = Registry(
    "demonstration builder", "sft.demonstrations", [("gsm8k_python", _gsm8k_python)])
"""``sft.demonstrations`` registry: name -> builder (a task's own builder is registered by its plugin
with :func:`register_demonstrations`, or named by import path ``module:attr``)."""


def register_demonstrations(name: str) -> Callable[[DemonstrationBuilder], DemonstrationBuilder]:
    """Decorator adding a demonstration builder to :data:`DEMONSTRATION_BUILDERS` under ``name``.

    Raises:
        ValueError: ``name`` is already registered to another builder.
    """
    return DEMONSTRATION_BUILDERS.register(name)


def is_demonstrations_file(source: str) -> bool:
    """``sft.demonstrations`` names a file of ``messages`` rows (by its suffix) rather than a builder."""
    return source.endswith((".jsonl", ".json", ".jsonl.gz", ".parquet"))


def load_demonstrations(source: str, rows: Sequence[dict], *, system_prompt: str | None,
                        tool_fraction: float, seed: int, limit: int) -> list[list[dict[str, Any]]]:
    """Demonstrations (lists of chat messages) from a builder or a file of ``messages`` rows.

    Args:
        source: ``sft.demonstrations``: a jsonl/parquet path, a key of :data:`DEMONSTRATION_BUILDERS`,
            or an import path ``module:attr`` of a builder (``module`` dotted or a ``.py`` file, as
            for tools and rewards; see :mod:`megarl.plugins`).
        rows: the training prompt rows (builders turn them into demonstrations).
        system_prompt: prepended by builders (a file's messages are used as they are).
        tool_fraction, seed: builder settings.
        limit: keep at most this many.

    Raises:
        ValueError: a missing file, a file row without ``messages``, a builder that is not registered
            or cannot be imported (:class:`~megarl.plugins.PluginError`), or no demonstration at all
            (each names ``sft.demonstrations``).
    """
    from pathlib import Path

    from megarl.data.datasets import read_rows

    if is_demonstrations_file(source):
        if not Path(source).is_file():
            raise ValueError(f"sft.demonstrations: file not found: {source}")
        file_rows = read_rows(source)
        for i, row in enumerate(file_rows):
            if not isinstance(row.get("messages"), list):
                raise ValueError(f"sft.demonstrations: {source} row {i} has no 'messages' list")
        demos = [row["messages"] for row in file_rows]
    else:
        builder = DEMONSTRATION_BUILDERS.resolve(source)  # a registered name or an import path
        demos = list(builder(list(rows[:limit * 2]), system_prompt=system_prompt, tool_fraction=tool_fraction,
                             seed=seed))
    if not demos:
        raise ValueError(f"sft.demonstrations: {source!r} produced no demonstration")
    return demos[:limit]
