"""The chat template of the agent loops: the prompt rendered once, then only what a loop appends
between turns tokenised (:class:`ChatTemplate`); :func:`build_template` makes the one of
``rollout.agent`` for a model, with the family's reasoning format and tool-call parser.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from megarl.rollout.reasoning import ReasoningFormat, resolve_parsers
from megarl.rollout.tools.calls import ToolCallParser
from megarl.rollout.types import Tool

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
        self.prompt_opens_reasoning = reasoning is not None and reasoning.leaves_open(self.generation_prompt)
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

    reasoning, tool_parser = resolve_parsers(tokenizer, agent.reasoning_parser, agent.tool_call_parser)
    kwargs = agent.chat_template_kwargs or {}
    kwargs = cast(dict, OmegaConf.to_container(kwargs)) if OmegaConf.is_config(kwargs) else dict(kwargs)
    template = ChatTemplate(tokenizer, [t.schema for t in tools.values()], agent.system_prompt,
                            eos_token_ids, chat_template_kwargs=kwargs,
                            reasoning=ReasoningFormat(reasoning) if reasoning else None)
    return template, (ToolCallParser(tools, tool_parser) if tools else None)
