"""Tool calls: parse them from model text with SGLang's ``FunctionCallParser``; run them concurrently.

Parsing is SGLang's own (``FunctionCallParser(tools, "qwen25").parse_non_stream``), in-process; it
imports without the CPU server shims (``sglang.srt.function_call.function_call_parser``, ~6 s the
first time). SGLang silently drops a ``<tool_call>`` block whose JSON is broken or whose function is
unknown; the policy must see those mistakes, so each block the model opened is parsed on its own and
a block SGLang rejects becomes a :class:`ToolCall` with an ``error`` (bad JSON, unknown tool,
missing end tag). Arguments are validated against the tool's JSON schema (``jsonschema``) before
the tool runs; every failure, timeout or exception becomes an ``Error: ...`` observation.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping

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


class ToolCallParser:
    """Find tool calls in one assistant turn's text with SGLang's parser.

    Args:
        tools: the tools offered to the model (their OpenAI-style ``schema``).
        parser_name: SGLang ``FunctionCallParser`` name; ``qwen25`` covers Qwen2.5 and Qwen3.

    Raises:
        ValueError: SGLang does not know ``parser_name``.
    """

    def __init__(self, tools: Mapping[str, Tool], parser_name: str = "qwen25") -> None:
        from sglang.srt.entrypoints.openai.protocol import Tool as SglTool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        self.tool_names = list(tools)
        self._parser = FunctionCallParser([SglTool(**t.schema) for t in tools.values()], parser_name)
        detector = self._parser.detector
        # The block markers, without the newlines qwen25 requires (so a sloppy block still counts as
        # an attempted call and gets an error observation instead of silently vanishing).
        self._start = getattr(detector, "bot_token", "<tool_call>").strip()
        self._end = getattr(detector, "eot_token", "</tool_call>").strip()
        self._block = re.compile(re.escape(self._start) + r".*?(?:" + re.escape(self._end) + "|$)",
                                 re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call the text attempts, in order; empty when it attempts none."""
        if self._start not in text:
            return []
        calls: list[ToolCall] = []
        for match in self._block.finditer(text):
            block = match.group(0)
            _, items = self._parser.parse_non_stream(block)
            if items:
                for item in items:
                    calls.append(_tool_call_from_item(item.name, item.parameters))
            else:
                calls.append(self._diagnose(block))
        return calls

    def _diagnose(self, block: str) -> ToolCall:
        """Explain why SGLang's parser rejected ``block``."""
        if not block.endswith(self._end):
            return ToolCall(name=None, arguments=None, error=f"unterminated tool call: missing "
                                                             f"{self._end}")
        body = block[len(self._start):-len(self._end)]
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall(name=None, arguments=None, error=f"tool call is not valid JSON ({e})")
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str):
            return ToolCall(name=None, arguments=None,
                            error='tool call needs {"name": ..., "arguments": {...}}')
        if name not in self.tool_names:
            return ToolCall(name=name, arguments=None,
                            error=f"unknown tool {name!r} (available: {', '.join(self.tool_names)})")
        return ToolCall(name=name, arguments=None,
                        error=f"malformed tool call; write {self._start}\\n{{json}}\\n{self._end}")


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

    if call.error is not None:
        return result(f"Error: {call.error}", True)
    tool = tools.get(call.name)
    if tool is None:
        return result(f"Error: unknown tool {call.name!r} (available: {', '.join(tools)})", True)
    try:
        jsonschema.validate(call.arguments, tool.schema["function"].get("parameters") or {})
    except jsonschema.ValidationError as e:
        return result(f"Error: invalid arguments for {call.name}: {e.message}", True)
    try:
        text = await asyncio.wait_for(tool(call.arguments), timeout_s)
    except asyncio.TimeoutError:
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
