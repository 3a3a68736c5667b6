"""examples/arithmetic_tool: the committed data is what make_data.py writes; the demo model's compact
chat template lists tools by name and renders tool calls and tool results like Qwen's."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "arithmetic_tool"


def test_committed_data_is_regenerated_by_make_data(tmp_path):
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--out-dir", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "data" / name).read_bytes(), name


@pytest.mark.timeout(120)
def test_compact_template_names_tools_and_keeps_the_qwen_tool_format(tiny_moe_dir):
    from transformers import AutoTokenizer

    sys.path.insert(0, str(EXAMPLE))
    try:
        from make_model import compact_template
    finally:
        sys.path.remove(str(EXAMPLE))
    from megarl.plugins import import_module
    from megarl.rollout.tools import build_tools

    demonstration = import_module(str(EXAMPLE / "task.py"), "plugins").demonstration

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    row = {"question": 'What is "48 + 73"?', "answer": "121", "expression": "48 + 73"}
    messages = demonstration(row, use_tool=True)
    tools = [t.schema for t in build_tools({"calculator": {}}).values()]
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    compact = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=compact_template())
    assert compact.startswith("<|im_start|>system\n# Tools: calculator<|im_end|>\n")
    assert '"parameters"' in full and '"parameters"' not in compact  # the JSON schemas are gone
    tail = full[full.index("<|im_start|>user"):]  # everything after the system block is unchanged
    assert compact.endswith(tail)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 + 73"}}\n</tool_call>' in compact
    with pytest.raises(ValueError, match="tools block"):
        compact_template("{{ messages }}")
