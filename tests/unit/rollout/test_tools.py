"""Tool registry, calculator, SGLang-based tool-call parsing and execution."""
import asyncio
import json
import math

import pytest

from megarl.rollout.tools import TOOL_REGISTRY, build_tools
from megarl.rollout.tools.calculator import CalculatorTool, calculate, format_number
from megarl.rollout.tools.calls import ToolCall, ToolCallParser, run_tool_call, run_tool_calls


def block(obj):
    return "<tool_call>\n" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tools():
    return build_tools({"python": {"timeout_s": 5}, "calculator": None})


@pytest.fixture(scope="module")
def parser(tools):
    return ToolCallParser(tools, "qwen25")


def test_registry_builds_and_rejects():
    assert {"python", "calculator"} <= set(TOOL_REGISTRY)
    tools = build_tools({"calculator": {}, "python": {"timeout_s": 2, "memory_mb": 256}})
    assert list(tools) == ["calculator", "python"] and tools["python"].timeout_s == 2.0
    with pytest.raises(ValueError, match="rollout.tools.browser: unknown tool"):
        build_tools({"browser": {}})
    with pytest.raises(ValueError, match="rollout.tools.python"):
        build_tools({"python": {"no_such_setting": 1}})


@pytest.mark.parametrize("expression", ["1 + 2 * 3", "(48 + 24) / 2", "2 ** 10 - 1", "7 // 2 + 7 % 2",
                                        "-3.5 * 2", "sqrt(16) + abs(-2)", "max(3, 9, 4)", "0.1 + 0.2"])
def test_calculator_matches_python(expression):
    reference = eval(expression, {"sqrt": math.sqrt, "abs": abs, "max": max})  # trusted literals
    assert float(calculate(expression)) == pytest.approx(reference)
    assert float(format_number(calculate(expression))) == pytest.approx(reference)


@pytest.mark.parametrize("expression", ["__import__('os')", "open('x')", "a + 1", "9 ** 9 ** 9",
                                        "[1, 2]", "1 +", "(1).real", "'a' * 3"])
async def test_calculator_refuses(expression):
    text = await CalculatorTool()({"expression": expression})
    assert text.startswith("Error:")


async def test_calculator_division_by_zero():
    assert (await CalculatorTool()({"expression": "1 / 0"})).startswith("Error:")


def test_parser_uses_sglang_format(parser):
    text = ("Let me compute. " + block({"name": "calculator", "arguments": {"expression": "2+2"}}) + "\n"
            + block({"name": "python", "arguments": {"code": "print(1)"}}))
    calls = parser.parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+2"}, None), ("python", {"code": "print(1)"}, None)]
    assert parser.parse("The answer is 4.") == []


@pytest.mark.parametrize("text,needle", [
    (block('{"name": "calculator", "arguments": {"expression": "1"'), "not valid JSON"),
    (block({"name": "web_search", "arguments": {}}), "unknown tool 'web_search'"),
    (block({"arguments": {"expression": "1"}}), '{"name": ..., "arguments": {...}}'),
    ('<tool_call>\n{"name": "calculator", "arguments": {}}', "unterminated"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>', "malformed"),
])
def test_parser_reports_malformed_blocks(parser, text, needle):
    calls = parser.parse(text)
    assert len(calls) == 1 and calls[0].error is not None and needle in calls[0].error


@pytest.mark.parametrize("arguments,needle", [
    ({"expression": 12}, "12 is not of type 'string'"),
    ({}, "'expression' is a required property"),
])
async def test_wrong_argument_types_become_observations(tools, arguments, needle):
    result = await run_tool_call(ToolCall(name="calculator", arguments=arguments), tools,
                                 timeout_s=5, max_output_chars=100)
    assert result.is_error and result.text.startswith("Error:") and needle in result.text


async def test_tool_exception_and_timeout_become_observations():
    class Broken:
        name = "broken"
        schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object"}}}

        async def __call__(self, arguments):
            raise RuntimeError("boom")

    class Slow(Broken):
        name = "slow"

        async def __call__(self, arguments):
            await asyncio.sleep(30)

    tools = {"broken": Broken(), "slow": Slow()}
    results = await run_tool_calls([ToolCall(name="broken", arguments={}), ToolCall(name="slow", arguments={})],
                                   tools, timeout_s=0.2, max_output_chars=100)
    assert "RuntimeError: boom" in results[0].text and "timed out" in results[1].text
    assert all(r.is_error for r in results)


async def test_observation_is_truncated(tools):
    result = await run_tool_call(ToolCall(name="calculator", arguments={"expression": "10 ** 99"}),
                                 tools, timeout_s=5, max_output_chars=20)
    assert result.text == "1" + "0" * 19 + "\n[truncated]"



def test_sglang_parser_needs_no_server_shims(parser):
    """Tool calls are parsed in the trainer-side process with SGLang's own code, without the CPU
    kernel shim the server needs: ``sgl_kernel`` is not even importable here."""
    import importlib.util
    import sys

    assert importlib.util.find_spec("sgl_kernel") is None and "sgl_kernel" not in sys.modules
    assert type(parser._parser).__module__ == "sglang.srt.function_call.function_call_parser"
