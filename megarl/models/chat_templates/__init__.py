"""Official chat templates of the supported model families (sources and licences in README.md).

:func:`load_template` returns a template's text; :data:`TEMPLATE_TOKENS` lists the special tokens a
tokenizer needs for it (what the released tokenizer has), used by the tiny-model builder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True)
class TemplateTokens:
    """The special tokens a chat template writes, as the released tokenizer defines them.

    Attributes:
        special: tokens that must be single special tokens (beyond the tiny tokenizer's own).
        eos: the tokenizer's ``eos_token``.
        bos: the tokenizer's ``bos_token`` (the template writes ``{{ bos_token }}``), or None.
        extra_stop: further end-of-turn tokens listed as EOS in ``generation_config.json``.
    """

    special: tuple[str, ...] = ()
    eos: str = "<|im_end|>"
    bos: str | None = None
    extra_stop: tuple[str, ...] = ()


_DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
"""The special tokens of DeepSeek-V3's tokenizer that the R1 and V3.1 templates write."""

TEMPLATE_TOKENS: dict[str, TemplateTokens] = {
    # Qwen3-8B: eos <|im_end|>; generation_config also stops on <|endoftext|>.
    "qwen3": TemplateTokens(extra_stop=("<|endoftext|>",)),
    # DeepSeek-R1 (DeepSeek-V3 architecture): BOS and EOS written by the template, tool-call markers
    # as special tokens.
    "deepseek_r1": TemplateTokens(special=_DEEPSEEK_SPECIAL, eos="<｜end▁of▁sentence｜>",
                                  bos="<｜begin▁of▁sentence｜>"),
    # DeepSeek-V3.1 (same architecture and markers): `thinking` switches the generation prompt between
    # "<｜Assistant｜><think>" and "<｜Assistant｜></think>"; tool calls as name<｜tool▁sep｜>{json}.
    "deepseek_v31": TemplateTokens(special=_DEEPSEEK_SPECIAL, eos="<｜end▁of▁sentence｜>",
                                   bos="<｜begin▁of▁sentence｜>"),
    # GLM-4.5: no end-of-turn token; generation stops on <|user|> or <|observation|> (generation_config).
    "glm4_moe": TemplateTokens(
        special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                 "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        eos="<|endoftext|>", extra_stop=("<|user|>", "<|observation|>")),
}
"""Template name -> its special tokens."""


def load_template(name: str) -> str:
    """The text of the official template ``name`` (a key of :data:`TEMPLATE_TOKENS`).

    Raises:
        ValueError: unknown name.
    """
    if name not in TEMPLATE_TOKENS:
        raise ValueError(f"chat_template: unknown template {name!r} (known: {', '.join(TEMPLATE_TOKENS)})")
    return (_DIR / f"{name}.jinja").read_text(encoding="utf-8")
