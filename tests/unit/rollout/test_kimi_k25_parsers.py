"""Kimi-K2.5's turns through megarl's reasoning split and tool-call parser with the parsers its
``Family`` names (SGLang 0.5.23's ``kimi_k2`` reasoning parser and function-call detector).

The turns are written in the format xgrammar 0.2.7's ``kimi`` structural tag constrains Kimi-K2 /
Kimi-K2.5 output to (``xgrammar/builtin_structural_tag.py``, ``get_kimi_structural_tag``, after
Moonshot's ``docs/tool_call_guidance.md``): ``<think>...</think>`` reasoning, then
``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
<|tool_call_end|>...<|tool_calls_section_end|>``. Kimi-K2.5's official chat template is not on this
machine (no installed package ships it, no network), so no template-rendered turn stands here.
"""
import json

import pytest

from megarl.rollout.reasoning import ReasoningFormat, family_parsers
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.calls import ToolCallParser

REASONING, TOOLS = family_parsers()["kimi_k25"]


def _calls(*calls: tuple[str, dict]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(args)}"
                   f"<|tool_call_end|>" for i, (name, args) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def test_the_family_names_sglangs_kimi_k2_parsers():
    assert (REASONING, TOOLS) == ("kimi_k2", "kimi_k2")


@pytest.mark.timeout(60)
def test_a_tool_call_turn_splits_into_reasoning_and_calls():
    tools = build_tools({"python": {"timeout_s": 5}, "calculator": None})
    thought, code, expr = "Need 2+3; run it, then check.", {"code": "print(2 + 3)"}, {"expression": "2 + 3"}
    turn = f"<think>{thought}</think>" + _calls(("python", code), ("calculator", expr))
    reasoning, answer = ReasoningFormat(REASONING).split(turn, in_reasoning=False)
    assert reasoning == thought
    calls = ToolCallParser(tools, TOOLS).parse(answer)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("python", code, None), ("calculator", expr, None)]


@pytest.mark.timeout(60)
def test_a_final_turn_has_reasoning_an_answer_and_no_call():
    tools = build_tools({"calculator": None})
    turn = "<think>2+3 is 5.</think>The answer is \\boxed{5}."
    reasoning, answer = ReasoningFormat(REASONING).split(turn, in_reasoning=False)
    assert (reasoning, answer.strip()) == ("2+3 is 5.", "The answer is \\boxed{5}.")
    assert ToolCallParser(tools, TOOLS).parse(answer) == []
