"""gpt-oss's harmony turns through megarl's reasoning split and tool-call parser with the parsers its
``Family`` names (SGLang 0.5.23's ``gpt-oss`` reasoning parser and function-call detector).

The turns are written in the harmony format as SGLang's detectors document it (analysis channel =
reasoning, ``commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`` = a tool
call, final channel = the answer). openai_harmony's own renderer cannot be used here: its encoding
downloads the o200k_base vocabulary at load, and this machine has no network.
"""
import json

import pytest

from megarl.rollout.reasoning import ReasoningFormat, family_parsers
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.calls import ToolCallParser

REASONING, TOOLS = family_parsers()["gpt_oss"]


def _call(name: str, arguments: dict) -> str:
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(arguments)}<|call|>")


@pytest.mark.timeout(60)
def test_a_tool_call_turn_splits_into_reasoning_and_a_call():
    tools = build_tools({"python": {"timeout_s": 5}, "calculator": None})
    thought, code = "Need 2+3; run it in python.", {"code": "print(2 + 3)"}
    turn = f"<|channel|>analysis<|message|>{thought}<|end|>" + _call("python", code)
    reasoning, answer = ReasoningFormat(REASONING).split(turn, in_reasoning=False)
    assert reasoning == thought
    calls = ToolCallParser(tools, TOOLS).parse(answer)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("python", code, None)]


@pytest.mark.timeout(60)
def test_a_final_turn_has_reasoning_an_answer_and_no_call():
    tools = build_tools({"calculator": None})
    turn = ("<|channel|>analysis<|message|>2+3 is 5.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>The answer is \\boxed{5}.<|return|>")
    reasoning, answer = ReasoningFormat(REASONING).split(turn, in_reasoning=False)
    assert (reasoning, answer) == ("2+3 is 5.", "The answer is \\boxed{5}.")
    assert ToolCallParser(tools, TOOLS).parse(answer) == []
