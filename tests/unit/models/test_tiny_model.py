"""The tiny-model tool: loads in transformers; the tokenizer round-trips every GSM8K question."""
import json

import torch
from safetensors import safe_open

from megarl.models.tiny import parse_tiny_uri
from megarl.models.tiny_tokenizer import default_gsm8k_dir


def test_loads_in_transformers_and_generates(tiny_moe_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    ids = tok("Natalia sold clips", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size == len(tok)
    assert torch.isfinite(logits).all()


def test_checkpoint_style_expert_names(tiny_moe_dir):
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)


def test_tokenizer_round_trips_every_gsm8k_question(tiny_moe_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    root = default_gsm8k_dir()
    questions = [json.loads(line)["question"] for split in ("train.jsonl", "test.jsonl")
                 for line in open(root / split, encoding="utf-8")]
    assert len(questions) > 8000
    encoded = tok(questions, add_special_tokens=False).input_ids
    decoded = tok.batch_decode(encoded, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    mismatches = [q for q, d in zip(questions, decoded) if q != d]
    assert not mismatches, mismatches[:3]


def test_chat_template_renders_tools_and_tool_calls(tiny_moe_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    tools = [{"type": "function", "function": {"name": "python", "description": "run code",
                                               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": {"code": "print(2+2)"}}}]},
                {"role": "tool", "content": "4"}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(2+2)"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert '"name": "python"' in text.split("<tools>\n")[1]


def test_dense_family(tiny_dense_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dense_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_tiny_uri_parsing():
    spec = parse_tiny_uri("tiny:qwen3?hidden_size=96&num_hidden_layers=4")
    assert (spec.family, spec.hidden_size, spec.num_hidden_layers) == ("qwen3", 96, 4)


def test_chat_template_text_exactly(tiny_moe_dir):
    """The rendered text, written out by hand in Qwen's format."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "think", "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                    {"type": "function", "function": {"name": "g", "arguments": {"b": 2}}}]},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                {"role": "assistant", "content": "done"}]
    expected = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nthink\n"
                '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call><|im_end|>\n'
                "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"
                "<|im_end|>\n<|im_start|>assistant\ndone<|im_end|>\n")
    assert tok.apply_chat_template(messages, tokenize=False) == expected
