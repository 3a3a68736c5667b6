"""Model families' reasoning and tool-call formats, read with SGLang's own parsers.

Each family writes its reasoning in a known format (SGLang's ``ReasoningParser`` names it) and its
tool calls in another (SGLang's ``FunctionCallParser`` detector names it). The agent loop splits every
model turn into reasoning and answer with the family's reasoning parser and reads tool calls and the
final answer from the answer only, so a draft call written while thinking is never run and a
``\\boxed{}`` written while thinking is never scored.

``auto`` (the config default) selects both from the model's family (``model_type`` in its
``config.json``); either can be set explicitly (``rollout.agent.reasoning_parser``,
``rollout.agent.tool_call_parser``), ``none`` turning reasoning separation off.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.models.families import all_families, find_family


def family_parsers() -> dict[str, tuple[str | None, str]]:
    """HF ``model_type`` (or a release's :class:`~megarl.models.families.ParserVariant` name) ->
    (reasoning parser, tool-call parser), SGLang names, as each :class:`~megarl.models.families.Family`
    declares them."""
    out = {}
    for family in all_families():
        for model_type in family.model_types:
            out[model_type] = (family.reasoning_parser, family.tool_call_parser)
        for variant in family.parser_variants:
            out[variant.name] = (variant.reasoning_parser, variant.tool_call_parser)
    return out


def model_type_of(tokenizer: Any) -> str | None:
    """``model_type`` from the ``config.json`` beside the tokenizer (None when there is none)."""
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def family_of(tokenizer: Any) -> str | None:
    """The :func:`family_parsers` key of a tokenizer's model: its ``model_type``, or the name of the
    family's :class:`~megarl.models.families.ParserVariant` whose marker its chat template holds."""
    model_type = model_type_of(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    family = find_family(model_type) if model_type else None
    for variant in family.parser_variants if family else ():
        if isinstance(template, str) and variant.marker in template:
            return variant.name
    return model_type


def resolve_parsers(tokenizer: Any, reasoning_parser: str | None = "auto",
                    tool_call_parser: str = "auto") -> tuple[str | None, str]:
    """The SGLang parser names to use: explicit names as given, ``auto`` from the model family.

    Args:
        tokenizer: the policy's tokenizer (its directory holds ``config.json``).
        reasoning_parser: a ``ReasoningParser`` name, ``none``/None (no reasoning separation) or ``auto``.
        tool_call_parser: a ``FunctionCallParser`` name or ``auto``.

    Returns:
        ``(reasoning_parser or None, tool_call_parser)``.

    Raises:
        ValueError: ``auto`` for a model no family handles (names the config key), or a
            name SGLang does not know.
    """
    family = None
    if "auto" in (reasoning_parser, tool_call_parser):
        model_type, known = family_of(tokenizer), family_parsers()
        family = known.get(model_type or "")
        if family is None:
            key = "reasoning_parser" if reasoning_parser == "auto" else "tool_call_parser"
            raise ValueError(
                f"rollout.agent.{key}: auto has no default for model family {model_type!r} "
                f"(known: {', '.join(known)}); set rollout.agent.reasoning_parser and "
                "rollout.agent.tool_call_parser to SGLang parser names")
    reasoning = family[0] if family and reasoning_parser == "auto" else reasoning_parser
    tools = family[1] if family and tool_call_parser == "auto" else tool_call_parser
    reasoning = None if reasoning in (None, "", "none") else reasoning
    if reasoning is not None:
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        if reasoning.lower() not in ReasoningParser.DetectorMap:
            raise ValueError(f"rollout.agent.reasoning_parser: SGLang has no reasoning parser {reasoning!r}")
    return reasoning, tools


def parser_issues(model_type: str | None, reasoning_parser: str | None,
                  tool_call_parser: str) -> list[tuple[str, str]]:
    """What :func:`resolve_parsers` would refuse, found before any process starts (``megarl validate``).

    Args:
        model_type: ``model_type`` of the model's ``config.json`` (None when unknown: ``auto`` is then
            not checked).
        reasoning_parser / tool_call_parser: ``rollout.agent``'s values.

    Returns:
        ``[(config key, message)]``, empty when both resolve. SGLang's parser tables are imported only
        for names set explicitly (``auto`` and ``none`` need no import).
    """
    issues = []
    known = family_parsers()
    family = known.get(model_type or "")
    for key, value in (("reasoning_parser", reasoning_parser), ("tool_call_parser", tool_call_parser)):
        if value == "auto" and model_type is not None and family is None:
            issues.append((f"rollout.agent.{key}", f"auto has no default for model family {model_type!r} "
                           f"(known: {', '.join(known)}); set it to an SGLang parser name"))
    if reasoning_parser not in (None, "", "none", "auto"):
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        if str(reasoning_parser).lower() not in ReasoningParser.DetectorMap:
            issues.append(("rollout.agent.reasoning_parser", f"SGLang has no reasoning parser {reasoning_parser!r} "
                           f"(known: {', '.join(sorted(ReasoningParser.DetectorMap))}, or none)"))
    if tool_call_parser != "auto":
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        if tool_call_parser not in FunctionCallParser.ToolCallParserEnum:
            issues.append(("rollout.agent.tool_call_parser", f"SGLang has no tool-call parser {tool_call_parser!r} "
                           f"(known: {', '.join(sorted(FunctionCallParser.ToolCallParserEnum))})"))
    return issues


class ReasoningFormat:
    """Split a model turn into reasoning and answer with SGLang's reasoning parser ``name``.

    Whether a turn starts inside reasoning is not guessed from the family: the text the loop appended
    before the turn says it (DeepSeek-R1's generation prompt ends in an open ``<think>\\n``; Qwen3's
    with ``enable_thinking: false`` in a closed empty block; after tool output none is open), see
    :meth:`leaves_open`.

    Args:
        name: an SGLang ``ReasoningParser`` name (``qwen3``, ``deepseek-v3``, ``glm45``, ...).
    """

    def __init__(self, name: str) -> None:
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        self.name = name
        self._parser_cls = ReasoningParser
        detector = ReasoningParser(name, stream_reasoning=False).detector
        self.think_start = detector.think_start_token
        self.think_end = detector.think_end_token

    def leaves_open(self, text: str) -> bool:
        """Whether ``text`` (a generation prompt or an appended suffix) ends inside reasoning."""
        start = text.rfind(self.think_start)
        return start >= 0 and text.rfind(self.think_end) < start

    def split(self, text: str, *, in_reasoning: bool) -> tuple[str, str]:
        """``(reasoning, answer)`` of one turn's text (SGLang's one-shot parse).

        Args:
            text: the turn as decoded (special tokens kept, final EOS dropped).
            in_reasoning: the turn started inside an open reasoning block.
        """
        parser = self._parser_cls(self.name, stream_reasoning=False, force_reasoning=in_reasoning)
        reasoning, answer = parser.parse_non_stream(text)
        return reasoning or "", answer or ""
