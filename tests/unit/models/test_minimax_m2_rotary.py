"""MiniMax-M2's partial RoPE as transformers releases before PR #48486 read it (the CUDA gap).

``tests/gpu/test_minimax_m2_gpu.py`` found Megatron's logits 0.32 from transformers' on an H200 node
whose transformers was 5.17.0, layer 0's attention output 0.03 off, norms and MoE exact. Those
releases keep ``rotary_dim`` as an opaque field (huggingface/transformers #48241): a config stating
only ``rotary_dim`` gets RoPE over the whole head. Removing ``MiniMaxM2Config.convert_rope_params_to_dict``
(the override PR #48486 added) reads a config as they do.

References: transformers 5.19's own forward (= Megatron's within 1e-5 on CPU,
``tests/integration/conversion/test_family_minimax_m2.py``), the same weights read the old way.
"""
import json

import pytest
import torch

ROWS, SEQ, SEED = 2, 48, 7
"""The GPU test's tokens (``megarl.testing.family_forward.forward_gaps``)."""


@pytest.fixture
def old_transformers(monkeypatch):
    """transformers as before PR #48486: no ``rotary_dim`` -> ``partial_rotary_factor`` mapping."""
    from transformers import MiniMaxM2Config

    assert "convert_rope_params_to_dict" in vars(MiniMaxM2Config), "transformers without PR #48486 installed"
    monkeypatch.delattr(MiniMaxM2Config, "convert_rope_params_to_dict")


def _rotated_dims(cfg) -> int:
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    return 2 * MiniMaxM2RotaryEmbedding(cfg).inv_freq.numel()


def test_tiny_config_rotates_rotary_dim_for_transformers_without_the_mapping(old_transformers):
    """The tiny builder states the factor itself: the old reading rotates ``rotary_dim`` dims too
    (before the fix: all 16)."""
    from megarl.models.tiny import TinyModelSpec, _hf_config

    cfg, _ = _hf_config(TinyModelSpec(family="minimax_m2"), 256, 1, 0)
    assert cfg.rotary_dim == cfg.head_dim // 2
    assert _rotated_dims(cfg) == cfg.rotary_dim


def _logits_and_first_attention(model, tokens):
    out = {}
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, o: out.update(attn=o[0]))
    with torch.no_grad():
        logits = model(tokens).logits
    handle.remove()
    return logits, out["attn"]


@pytest.mark.timeout(120)
def test_config_stating_only_rotary_dim_reproduces_the_cuda_gap(tiny_minimax_m2_dir, tmp_path, old_transformers):
    """The tiny checkpoint with a config.json as transformers 5.17 wrote it on the GPU node
    (``rotary_dim`` only), read by 5.17: its logits move by ~0.3 and layer 0's attention by ~0.03
    from the tiny config as written now (factor stated: the old reading rotates ``rotary_dim``, as 5.19
    and Megatron do), the GPU test's numbers."""
    from transformers import AutoModelForCausalLM

    raw = json.loads((tiny_minimax_m2_dir / "config.json").read_text())
    tokens = torch.randint(0, raw["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(SEED))
    old_dir = tmp_path / "as_written_by_5_17"
    old_dir.mkdir()
    for item in tiny_minimax_m2_dir.iterdir():
        if item.name != "config.json":
            (old_dir / item.name).symlink_to(item)
    stated_only_rotary_dim = {k: v for k, v in raw.items() if k != "partial_rotary_factor"}
    stated_only_rotary_dim["rope_parameters"] = {k: v for k, v in raw["rope_parameters"].items()
                                                 if k != "partial_rotary_factor"}
    (old_dir / "config.json").write_text(json.dumps(stated_only_rotary_dim))

    old_read = AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32).eval()
    stated = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2_dir, dtype=torch.float32).eval()
    assert _rotated_dims(old_read.config) == raw["head_dim"] and _rotated_dims(stated.config) == raw["rotary_dim"]

    old_logits, old_attn = _logits_and_first_attention(old_read, tokens)
    logits, attn = _logits_and_first_attention(stated, tokens)
    logit_gap, attn_gap = (old_logits - logits).abs().max().item(), (old_attn - attn).abs().max().item()
    print(f"\nrotary_dim only, read as 5.17: logits {logit_gap:.3g}, layer-0 attention {attn_gap:.3g}")
    # the GPU test's 0.32 and 0.03 (here: 0.318 and 0.0296)
    assert abs(logit_gap - 0.32) < 0.02 and abs(attn_gap - 0.03) < 0.005, (logit_gap, attn_gap)
