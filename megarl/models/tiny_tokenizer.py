"""The tiny models' tokenizer: a byte-level BPE trained on the GSM8K text (``tokenizers``), Qwen-style
special tokens and a chat template that renders system / user / assistant / tool messages and
``<tool_call>{json}</tool_call>`` blocks (used by :mod:`megarl.models.tiny`).
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]

# Qwen2.5/Qwen3-style template (no thinking section). Assistant turns render their content verbatim
# and then any structured tool_calls, as Qwen's own template does; tool results are wrapped in
# <tool_response> inside a user turn, consecutive tool messages sharing one user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{%- if loop.first and message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set args = tc.function.arguments %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + tc.function.name + '\\\", \\\"arguments\\\": ' }}"
    "{{- args if args is string else args | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_gsm8k_dir() -> Path:
    """The GSM8K directory: ``MEGARL_GSM8K_DIR``, else the repository's ``data/gsm8k``.

    Raises:
        FileNotFoundError: neither holds ``train.jsonl``.
    """
    env = os.environ.get("MEGARL_GSM8K_DIR")
    if env:
        return Path(env)
    shipped = Path(__file__).resolve().parents[2] / "data" / "gsm8k"  # the repository's copy
    if (shipped / "train.jsonl").is_file():
        return shipped
    raise FileNotFoundError(
        f"GSM8K not found at {shipped}: set MEGARL_GSM8K_DIR to a directory with train.jsonl and test.jsonl")


def gsm8k_texts(gsm8k_dir: str | os.PathLike | None = None) -> Iterator[str]:
    """Yield every question and answer of GSM8K (train and test).

    Raises:
        FileNotFoundError: no GSM8K directory was found.
    """
    root = Path(gsm8k_dir) if gsm8k_dir else default_gsm8k_dir()
    for split in ("train.jsonl", "test.jsonl"):
        with open(root / split, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield row["question"]
                yield row["answer"]


_EXTRA_CORPUS = [
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(12 * 7)"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4 * 2"}}\n</tool_call>',
    "You are a helpful assistant. Use the tools when they help. The final answer is \\boxed{42}.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "def solve():\n    return sum(range(10))\nprint(solve())\nTraceback (most recent call last): Error",
]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    Byte-level pre-tokenisation without a prefix space makes ``decode(encode(text)) == text`` for
    every string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok, chat_template: str = "tiny"):
    """A ``tokenizers.Tokenizer`` as a ``PreTrainedTokenizerFast`` with megarl's special tokens and
    template, or with an official template and its special tokens (added after the trained vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, additional_special_tokens=SPECIAL_TOKENS[3:],
        clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    if chat_template != "tiny":
        from megarl.models.chat_templates import TEMPLATE_TOKENS, load_template

        hf_tok.chat_template = load_template(chat_template)
        tokens = TEMPLATE_TOKENS[chat_template]
        hf_tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:] + list(tokens.special)})
        hf_tok.eos_token, hf_tok.bos_token = tokens.eos, tokens.bos
    return hf_tok


def stop_token_ids(tok, chat_template: str) -> list[int]:
    """EOS ids of ``generation_config.json``: the tokenizer's EOS and the template's other stops."""
    if chat_template == "tiny":
        return [tok.eos_token_id]
    from megarl.models.chat_templates import TEMPLATE_TOKENS

    return [tok.eos_token_id] + tok.convert_tokens_to_ids(list(TEMPLATE_TOKENS[chat_template].extra_stop))


@functools.lru_cache(maxsize=4)
def _gsm8k_tokenizer_json(vocab_size: int, gsm8k_dir: str | None) -> str:
    """The GSM8K-trained tokenizer as ``tokenizers`` JSON, cached per process: training takes
    seconds and gives the same tokenizer for the same corpus and size."""
    texts = list(gsm8k_texts(gsm8k_dir)) + _EXTRA_CORPUS * 20
    return train_tokenizer(texts, vocab_size).backend_tokenizer.to_str()


def tiny_tokenizer(vocab_size: int, gsm8k_dir: str | os.PathLike | None = None, chat_template: str = "tiny"):
    """The tiny models' tokenizer: BPE of ``vocab_size`` trained on GSM8K (cached per process),
    with ``chat_template`` (``tiny``: :data:`CHAT_TEMPLATE`; else an official one and its tokens).

    Raises:
        FileNotFoundError: GSM8K not found.
    """
    from tokenizers import Tokenizer

    return wrap_tokenizer(Tokenizer.from_str(
        _gsm8k_tokenizer_json(vocab_size, str(gsm8k_dir) if gsm8k_dir else None)), chat_template)
