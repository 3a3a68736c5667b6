#!/usr/bin/env python3
"""Write the demonstration's policy: a tiny random Qwen3-MoE whose chat template lists tools compactly.

    python examples/arithmetic_tool/make_model.py OUT_DIR [--seed N]

The model is ``megarl.models.tiny`` 's tiny Qwen3-MoE (2 layers, 8 experts, top-2, local
BPE tokenizer) with RoPE base 10,000 instead of 1,000,000 (a 64-wide model needs the faster
rotary frequencies to attend to a token a fixed distance back). One thing differs from Qwen's
template: the system block lists the tools by name (``# Tools: calculator``) instead of their
~300-token JSON schemas. A tiny model learns its tool from the SFT demonstrations, not from a
schema it cannot read, and a 25-token prompt instead of a 380-token one is what lets it learn to
copy the expression into the tool call within a few hundred CPU steps. Tool calls keep the Qwen
format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, SGLang's ``qwen25`` parser).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megarl.models.tiny import TinyModelSpec, make_tiny_model
from megarl.models.tiny_tokenizer import CHAT_TEMPLATE

_TOOLS_START = "{{- '# Tools\\n\\n"
_TOOLS_END = "</tool_call><|im_end|>\\n' }}"
# The same block in the official Qwen3 template (double-quoted there).
_QWEN3_TOOLS_START = '{{- "# Tools\\n\\n'
_QWEN3_TOOLS_END = '</tool_call><|im_end|>\\n" }}'
COMPACT_TOOLS = "{{- '# Tools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}" \
                "{{- '<|im_end|>\\n' }}"


def compact_template(template: str = CHAT_TEMPLATE) -> str:
    """``template`` with its tools block (instructions + JSON schemas) replaced by the tool names.

    Raises:
        ValueError: the template's tools block was not found (the tiny-model template changed).
    """
    for tools_start, tools_end in ((_TOOLS_START, _TOOLS_END), (_QWEN3_TOOLS_START, _QWEN3_TOOLS_END)):
        start = template.find(tools_start)
        end = template.find(tools_end, start)
        if start >= 0 and end >= 0:
            return template[:start] + COMPACT_TOOLS + template[end + len(tools_end):]
    raise ValueError("the chat template has no recognisable tools block")


def make_model(out_dir: str | Path, seed: int = 0, chat_template: str = "tiny") -> Path:
    """Write the demo model into ``out_dir`` (skipped when it already holds one).

    ``chat_template``: ``tiny`` (megarl's append-only template) or ``qwen3`` (the official Qwen3
    template, megarl/models/chat_templates/qwen3.jinja: <think> handling, ``enable_thinking``);
    either with the compact tools block.
    """
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    make_tiny_model(out, TinyModelSpec(family="qwen3_moe", rope_theta=10000.0, seed=seed, chat_template=chat_template))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = compact_template(tokenizer.chat_template)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template", default="tiny", choices=["tiny", "qwen3"])
    args = parser.parse_args()
    print(make_model(args.out_dir, args.seed, args.chat_template))
