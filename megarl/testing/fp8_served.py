"""A block-FP8 served copy of a Hugging Face model, for the post-sync check's FP8-engine bound.

What an SGLang engine serving a block-FP8 checkpoint computes, in plain torch: every matrix SGLang
quantises (:meth:`megarl.models.fp8_blocks.BlockFP8.is_quantized`, each expert's matrix on its own)
quantised to e4m3 in 128 x 128 blocks and dequantised (:func:`quantize_blockwise` /
:func:`dequantize_blockwise`), and the activations into those linears quantised per token in groups
of 128, as DeepSeek-V3's block-FP8 GEMMs do. Used by tests/unit/training/test_fp8_engine_tolerance.py
(CPU) and tests/gpu/test_fp8_engine_gap_gpu.py (CUDA); stdlib and torch only (a bare GPU node).
"""
from __future__ import annotations

import torch

from megarl.models.fp8_blocks import E4M3_MAX, BlockFP8, dequantize_blockwise, quantize_blockwise


def act_quant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-token, per-``group``-channel e4m3 quantise-dequantise of ``x`` (``[..., channels]``, same
    shape and dtype back)."""
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, (-cols) % group)).unflatten(-1, (-1, group))
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)[..., :cols].to(x.dtype)


def _block_fp8(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(w.float()), dtype=w.dtype)


def quantise_served(model: torch.nn.Module) -> int:
    """Every weight SGLang serves as block FP8, quantised and dequantised in place (transformers 5
    fuses experts into ``[E, rows, cols]``, gate and up stacked: each checkpoint matrix on its own);
    a forward pre-hook quantises the activations into those linears (:func:`act_quant`).

    Returns:
        How many matrices were quantised.
    """
    rule, count = BlockFP8(), 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                halves = 2 if name.endswith("gate_up_proj") else 1
                for e in range(p.shape[0]):
                    for part in p.data[e].chunk(halves, dim=0):
                        part.copy_(_block_fp8(part.clone()))
                        count += 1
            elif rule.is_quantized(name, tuple(p.shape)):
                p.copy_(_block_fp8(p.data))
                count += 1
                module = model.get_submodule(name[:-len(".weight")])
                module.register_forward_pre_hook(lambda _, args: (act_quant(args[0]),) + tuple(args[1:]))
    return count


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq - 1]`` fp32 log-probabilities of ``ids`` (``[batch, seq]``) under ``model``."""
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
