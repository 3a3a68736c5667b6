"""DeepSeek-V3.1's official chat template (megarl/models/chat_templates/deepseek_v31.jinja).

References: the conversation llama.cpp renders as its example when it loads a DeepSeek-V3.1 GGUF
(printed in its log with the embedded template), and SGLang 0.5.23's own DeepSeek-V3.1 tool-call
detector (``deepseekv31``), which must read back the calls the template writes.
"""
import json

import pytest

from megarl.models.chat_templates import load_template
from megarl.rollout.reasoning import family_of, resolve_parsers

CALLS = [("calculator", {"expression": "48 / 2"}), ("search", {"query": "clips sold in May", "k": 3})]


def render(messages, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=load_template("deepseek_v31"),
                                        **kwargs)
    return rendered[0]


def test_llama_cpp_example_renders_identically():
    messages = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "How are you?"}]
    expected = ("You are a helpful assistant<｜User｜>Hello<｜Assistant｜></think>Hi there<｜end▁of▁sentence｜>"
                "<｜User｜>How are you?<｜Assistant｜><think>")
    assert render(messages, add_generation_prompt=True, thinking=True, bos_token="") == expected
    # thinking off (the default) closes the reasoning in the generation prompt instead
    assert render(messages, add_generation_prompt=True, bos_token="") == expected[:-len("<think>")] + "</think>"


def test_tool_calls_parse_back_with_sglangs_detector():
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    calls = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in CALLS]
    messages = [{"role": "user", "content": "How many clips in May?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "24"}, {"role": "tool", "content": "[]"},
                {"role": "assistant", "content": "She sold 24."}]
    text = render(messages, bos_token="<｜begin▁of▁sentence｜>")
    start = text.index("<｜Assistant｜></think>") + len("<｜Assistant｜></think>")
    turn = text[start:text.index("<｜end▁of▁sentence｜>", start)]
    assert turn.startswith("<｜tool▁calls▁begin｜>") and turn.endswith("<｜tool▁calls▁end｜>")
    assert "<｜tool▁output▁begin｜>24<｜tool▁output▁end｜><｜tool▁output▁begin｜>[]<｜tool▁output▁end｜>" in text
    schemas = [Tool(type="function", function={"name": n, "parameters": {"type": "object", "properties": {}}})
               for n, _ in CALLS]
    _, items = FunctionCallParser(schemas, "deepseekv31").parse_non_stream(turn)
    assert [(i.name, json.loads(i.parameters)) for i in items] == CALLS
    # R1's detector does not read V3.1's format (no "function" type, no ```json fence)
    _, r1_items = FunctionCallParser(schemas, "deepseekv3").parse_non_stream(turn)
    assert [(i.name, json.loads(i.parameters)) for i in r1_items] != CALLS


def test_megarl_tool_parser_reads_v31_calls():
    from megarl.rollout.tools import build_tools
    from megarl.rollout.tools.calls import ToolCallParser

    parser = ToolCallParser(build_tools({"calculator": {}}), "deepseekv31")
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{\"expression\": \"1 + 1\"}"
            "<｜tool▁call▁end｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{oops}<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")
    first, second = parser.parse(text)
    assert (first.name, first.arguments, first.error) == ("calculator", {"expression": "1 + 1"}, None)
    assert second.name == "calculator" and "not valid JSON" in second.error


@pytest.mark.timeout(120)
def test_auto_parsers_tell_v31_from_r1(official_template_tokenizers):
    v31, r1 = official_template_tokenizers["deepseek_v31"], official_template_tokenizers["deepseek_r1"]
    assert family_of(v31) == "deepseek_v31" and family_of(r1) == "deepseek_v3"
    assert resolve_parsers(v31) == ("deepseek-v3", "deepseekv31")
    assert resolve_parsers(r1) == ("deepseek-v3", "deepseekv3")
