"""Tool calls: parse them from model text with SGLang's ``FunctionCallParser``; run them concurrently.

Parsing is SGLang's own detector of the model family (``FunctionCallParser(tools, name)``: ``qwen25``,
``deepseekv3``, ``glm45``, ...), in-process; it imports without the CPU server shims
(``sglang.srt.function_call.function_call_parser``, ~6 s the first time). SGLang silently drops a call
whose JSON is broken or whose function is unknown; the policy must see those mistakes, so each call
the model opened is parsed on its own and a call SGLang rejects becomes a :class:`ToolCall` with an
``error`` (bad JSON, unknown tool, missing end tag). Arguments are validated against the tool's JSON schema
(``jsonschema``) before
the tool runs; every failure, timeout or exception becomes an ``Error: ...`` observation.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from megarl.rollout.types import Tool


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One tool call the model wrote.

    Attributes:
        name: function name as written (None when it could not be read).
        arguments: parsed arguments (None when unparseable).
        error: why the call cannot run (bad JSON, unknown tool, unterminated), or None.
    """

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass(kw_only=True, slots=True)
class ToolResult:
    """The observation of one call: ``text`` is shown to the model; ``is_error`` for metrics."""

    name: str | None
    text: str
    is_error: bool
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class _CallFormat:
    """How one call of a tool-call format is delimited and explained (for error observations).

    ``start``/``end`` delimit one call; ``wrap`` is put around a single call before SGLang's detector
    parses it (DeepSeek's calls sit inside a ``<｜tool▁calls▁begin｜>`` section); ``name`` and
    ``arguments`` are regexes whose group 1 is the function name / JSON arguments (None: the whole
    body is ``{"name": ..., "arguments": ...}`` JSON); ``example`` is shown in the error.
    """

    start: str
    end: str
    wrap: tuple[str, str] = ("", "")
    name: str | None = None
    arguments: str | None = None
    example: str


_QWEN = _CallFormat(start="<tool_call>", end="</tool_call>",
                    example='<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>')
_FORMATS: dict[str, _CallFormat] = {
    "qwen25": _QWEN,
    "qwen": _QWEN,
    "deepseekv3": _CallFormat(
        start="<｜tool▁call▁begin｜>", end="<｜tool▁call▁end｜>",
        wrap=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
        name=r"<｜tool▁sep｜>([^\n]*)", arguments=r"```json\n(.*)\n```",
        example="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```"
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseekv31": _CallFormat(  # DeepSeek-V3.1: the name, then the JSON arguments, no type and no fence
        start="<｜tool▁call▁begin｜>", end="<｜tool▁call▁end｜>",
        wrap=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
        name=r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>", arguments=r"<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>",
        example="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>"),
    "glm45": _CallFormat(
        start="<tool_call>", end="</tool_call>", name=r"<tool_call>([^\n<]*)",
        example="<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"),
}
_FORMATS["glm"] = _FORMATS["glm45"]


class ToolCallParser:
    """Find tool calls in one assistant turn's answer with SGLang's detector of the model family.

    Each call the model opened is parsed on its own by SGLang's ``FunctionCallParser``; a call SGLang
    rejects (it drops those silently) becomes a :class:`ToolCall` with an ``error`` saying why. Give
    it the answer only (the agent loop strips the reasoning first): a call drafted inside
    ``<think>`` is not a call.

    Args:
        tools: the tools offered to the model (their OpenAI-style ``schema``).
        parser_name: SGLang ``FunctionCallParser`` name: ``qwen25`` (Qwen2.5 / Qwen3
            ``<tool_call>{json}</tool_call>``), ``deepseekv3`` (DeepSeek-V3 / R1), ``deepseekv31`` (DeepSeek-V3.1),
            ``glm45``
            (GLM-4.5 ``<arg_key>``/``<arg_value>``); other SGLang names parse, with generic errors.

    Raises:
        ValueError: SGLang does not know ``parser_name`` (names ``rollout.agent.tool_call_parser``).
    """

    def __init__(self, tools: Mapping[str, Tool], parser_name: str = "qwen25") -> None:
        from sglang.srt.entrypoints.openai.protocol import Tool as SglTool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        if parser_name not in FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"rollout.agent.tool_call_parser: SGLang has no tool-call parser {parser_name!r} "
                             f"(known: {', '.join(sorted(FunctionCallParser.ToolCallParserEnum))})")
        self.tool_names = list(tools)
        self._parser = FunctionCallParser([SglTool(**t.schema) for t in tools.values()], parser_name)
        detector = self._parser.detector
        # The call markers without the newlines qwen25 requires (so a sloppy call still counts as an
        # attempted call and gets an error observation instead of silently vanishing).
        self._format = _FORMATS.get(parser_name) or _CallFormat(
            start=getattr(detector, "bot_token", "<tool_call>").strip(),
            end=getattr(detector, "eot_token", "</tool_call>").strip(), example="the format of the tool prompt")
        self._start, self._end = self._format.start, self._format.end
        self._block = re.compile(re.escape(self._start) + r".*?(?:" + re.escape(self._end) + "|$)",
                                 re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call the text attempts, in order; empty when it attempts none."""
        if self._start not in text:
            return []
        calls: list[ToolCall] = []
        before, after = self._format.wrap
        for match in self._block.finditer(text):
            block = match.group(0)
            _, items = self._parser.parse_non_stream(before + block + after)
            if items:
                for item in items:
                    calls.append(_tool_call_from_item(item.name, item.parameters))
            else:
                calls.append(self._diagnose(block))
        return calls

    def _diagnose(self, block: str) -> ToolCall:
        """Explain why SGLang's parser rejected ``block``."""
        fmt = self._format
        if not block.endswith(self._end):
            return ToolCall(name=None, arguments=None, error=f"unterminated tool call: missing "
                                                             f"{self._end}")
        name, arguments = None, None
        try:
            if fmt.name is None:  # the whole body is {"name": ..., "arguments": ...}
                obj = json.loads(block[len(self._start):-len(self._end)])
                name = obj.get("name") if isinstance(obj, dict) else None
                if not isinstance(name, str):
                    return ToolCall(name=None, arguments=None,
                                    error='tool call needs {"name": ..., "arguments": {...}}')
            else:
                found = re.search(fmt.name, block)
                name = found.group(1).strip() if found else None
                found = re.search(fmt.arguments, block, re.DOTALL) if fmt.arguments else None
                arguments = json.loads(found.group(1)) if found else None
        except json.JSONDecodeError as e:
            return ToolCall(name=name, arguments=None, error=f"tool call is not valid JSON ({e})")
        if name and name not in self.tool_names:
            return ToolCall(name=name, arguments=None,
                            error=f"unknown tool {name!r} (available: {', '.join(self.tool_names)})")
        if arguments is not None and not isinstance(arguments, dict):
            return ToolCall(name=name, arguments=None, error="arguments must be a JSON object")
        return ToolCall(name=name, arguments=None,
                        error=f"malformed tool call; write {fmt.example}")


def _tool_call_from_item(name: str, parameters: str) -> ToolCall:
    try:
        arguments = json.loads(parameters) if parameters else {}
    except json.JSONDecodeError as e:
        return ToolCall(name=name, arguments=None, error=f"arguments are not valid JSON ({e})")
    if not isinstance(arguments, dict):
        return ToolCall(name=name, arguments=None, error="arguments must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


async def run_tool_call(call: ToolCall, tools: Mapping[str, Tool], *, timeout_s: float,
                        max_output_chars: int) -> ToolResult:
    """Run one call; never raises (except cancellation). Output longer than the limit is cut."""
    start = time.monotonic()

    def result(text: str, is_error: bool) -> ToolResult:
        if len(text) > max_output_chars:
            text = text[:max_output_chars] + "\n[truncated]"
        return ToolResult(name=call.name, text=text, is_error=is_error,
                          duration_s=time.monotonic() - start)

    if call.error is not None or call.name is None or call.arguments is None:
        return result(f"Error: {call.error or 'malformed tool call'}", True)
    tool = tools.get(call.name)
    if tool is None:
        return result(f"Error: unknown tool {call.name!r} (available: {', '.join(tools)})", True)
    try:
        jsonschema.validate(call.arguments, tool.schema["function"].get("parameters") or {})
    except jsonschema.ValidationError as e:
        return result(f"Error: invalid arguments for {call.name}: {e.message}", True)
    try:
        text = await asyncio.wait_for(tool(call.arguments), timeout_s)
    except TimeoutError:
        return result(f"Error: {call.name} timed out after {timeout_s:g} s", True)
    except Exception as e:  # noqa: BLE001 - a tool failure is an observation, not a crash
        return result(f"Error: {call.name} failed: {type(e).__name__}: {e}", True)
    return result(str(text), str(text).startswith("Error:") or "\nError: " in str(text))


async def run_tool_calls(calls: list[ToolCall], tools: Mapping[str, Tool], *, timeout_s: float,
                         max_output_chars: int) -> list[ToolResult]:
    """Run the calls of one turn concurrently; results in call order."""
    return list(await asyncio.gather(*(
        run_tool_call(c, tools, timeout_s=timeout_s, max_output_chars=max_output_chars)
        for c in calls)))
