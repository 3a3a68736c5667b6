"""Block-wise FP8 (e4m3) weights as DeepSeek-V3's and Qwen3's FP8 releases store them.

Format (``config.json``: ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``, optionally
``modules_to_not_convert`` / ``ignored_layers``): a quantised linear's ``<module>.weight`` ``[R, C]``
is stored as ``float8_e4m3fn`` next to a ``float32`` ``<module>.weight_scale_inv``
``[ceil(R / bn), ceil(C / bk)]`` (block ``[bn, bk]``, 128 x 128); the weight is

    w[i, j] = float(q[i, j]) * scale_inv[i // bn, j // bk]

(SGLang 0.5.23 ``fp8_utils.block_quant_dequant``: fp32 product, then the model dtype; the last
row / column of blocks may be partial). :func:`quantize_blockwise` produces that pair with
``scale_inv = amax(|w_block|) / 448`` (448 = e4m3's largest finite value, so every block's largest
element maps to +-448 exactly) and ``q = clamp(w / scale_inv, -448, 448)`` rounded to nearest by
the cast (the clamp keeps fp32 results that round above 448 in range whatever the backend's cast
does with them: e4m3fn has no infinity, and c10's scalar cast makes NaN of values >= 480).
``amax`` is clamped below at 1e-12, so an all-zero (or denormal) block gets
``scale_inv = 1e-12 / 448``, never 0 (any scale reproduces zeros; nothing divides by zero).
Round trip (fp32): ``|w - dequant(quant(w))| <= |w| / 16`` (3 mantissa bits, round to nearest)
for elements in e4m3's normal range (``|w| >= 2**-6 * scale_inv``), and ``<= scale_inv * 2**-10``
(half the subnormal step) below it.

Which tensors are quantised: SGLang quantises every ``LinearBase`` / ``FusedMoE`` layer not named
by ``modules_to_not_convert`` / ``ignored_layers`` (``Fp8Config.get_quant_method``); embeddings, the
LM head (vocab-parallel, not ``LinearBase``), norms and the MoE router (``mlp.gate``: an unquantised
linear in every family megarl maps) are not. :meth:`BlockFP8.is_quantized` is that rule on HF names;
a served checkpoint's headers are the authority where they can be read (the weight sync checks its
plan against them). Under tensor parallelism SGLang shards ``weight_scale_inv`` in whole blocks
along the weight's split (``BlockQuantScaleParameter``; it refuses layers whose per-rank rows /
columns are not multiples of the block), so quantising a rank's shard equals slicing the quantised
whole tensor at block boundaries.

Memory: both functions work on stripes of ``chunk_rows`` block rows, so the fp32 temporaries stay a
stripe's size, not the tensor's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
"""``<module>.weight`` -> ``<module>.weight_scale_inv``."""
_ZERO_AMAX = 1e-12


@dataclass(frozen=True)
class BlockFP8:
    """A served / stored checkpoint's block-FP8 settings (from its ``quantization_config``)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    """``weight_block_size`` ``[bn, bk]``: rows x columns per scale."""
    ignored: tuple[str, ...] = ()
    """``modules_to_not_convert`` / ``ignored_layers`` (module paths, with or without ``model.``)."""

    def is_quantized(self, name: str, shape: Sequence[int]) -> bool:
        """Whether the served checkpoint stores HF tensor ``name`` of ``shape`` as block FP8.

        True for 2-D ``*.weight`` of decoder-layer linears (``model.layers.*``) other than the MoE
        router (``*.mlp.gate.weight``) and modules matching ``ignored`` on dotted-path boundaries
        (equal, a prefix, or a dotted infix, as SGLang's ``is_layer_skipped`` matches).
        """
        if len(shape) != 2 or not name.endswith(".weight") or not name.startswith("model.layers."):
            return False
        module = name[:-len(".weight")]
        if module.endswith(".mlp.gate"):
            return False
        return not any(_path_match(ignored, module) for ignored in self.ignored)

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """``[ceil(R / bn), ceil(C / bk)]`` of a weight ``[R, C]``."""
        rows, cols = shape
        return -(-rows // self.block[0]), -(-cols // self.block[1])


def scale_name(weight_name: str) -> str:
    """``model.layers.0.mlp.down_proj.weight_scale_inv`` for ``...down_proj.weight``."""
    return weight_name + SCALE_SUFFIX


def _path_match(ignored: str, module: str) -> bool:
    ignored = ignored.rstrip(".").removeprefix("model.")
    module = module.removeprefix("model.")
    return module == ignored or module.startswith(ignored + ".") or f".{ignored}." in f".{module}."


def parse_quantization_config(config: Any, *, where: str = "quantization_config") -> BlockFP8 | None:
    """The :class:`BlockFP8` of a ``quantization_config`` (dict or object with ``to_dict``); None
    for no quantisation (absent or empty).

    Raises:
        ValueError: anything but dynamic block-wise e4m3 FP8 (names the field and value): another
            ``quant_method`` (``compressed-tensors``, ``mxfp8``, ...), ``fmt`` other than ``e4m3``,
            a missing or non-2-D ``weight_block_size`` (per-tensor FP8), a static activation scheme.
    """
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{where}.quant_method={method!r}: only block-wise FP8 ('fp8' with weight_block_size) "
                         f"is supported")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt={fmt!r}: only e4m3 (float8_e4m3fn) weights are supported")
    block = config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}.weight_block_size={block!r}: expected two positive ints such as [128, 128] "
                         f"(per-tensor FP8 is not supported)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{where}.activation_scheme={scheme!r}: block-wise FP8 needs 'dynamic' (as SGLang)")
    ignored = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return BlockFP8(block=(int(block[0]), int(block[1])), ignored=tuple(ignored))


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what}: block-wise FP8 needs a 2-D weight, got shape {tuple(w.shape)}")


def quantize_blockwise(w: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK, *,
                       chunk_rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantisation of one weight (see module docstring for the formula).

    Args:
        w: ``[R, C]`` float weight (bf16 / fp16 / fp32), any device.
        block: ``(bn, bk)``.
        chunk_rows: block rows per stripe (memory bound, not the result).

    Returns:
        ``(q, scale_inv)``: ``q`` ``[R, C]`` ``float8_e4m3fn`` and ``scale_inv``
        ``[ceil(R / bn), ceil(C / bk)]`` float32, on ``w``'s device.

    Raises:
        ValueError: ``w`` is not 2-D or not floating point.
    """
    _check_2d(w, "quantize_blockwise")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_blockwise: expected a bf16/fp16/fp32 weight, got {w.dtype}")
    bn, bk = block
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // bn), -(-cols // bk)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=w.device)
    scale_inv = torch.empty(nb_r, nb_c, dtype=torch.float32, device=w.device)
    pad_c = nb_c * bk - cols
    for b0 in range(0, nb_r, chunk_rows):
        b1 = min(b0 + chunk_rows, nb_r)
        r0, r1 = b0 * bn, min(b1 * bn, rows)
        stripe = w[r0:r1].float()
        padded = torch.nn.functional.pad(stripe, (0, pad_c, 0, (b1 - b0) * bn - (r1 - r0)))
        blocks = padded.view(b1 - b0, bn, nb_c, bk)
        amax = blocks.abs().amax(dim=(1, 3))  # [b, nb_c]
        scale = amax.clamp(min=_ZERO_AMAX) / E4M3_MAX  # no zero (or underflowing) scale to divide by
        scale_inv[b0:b1] = scale
        scaled = (blocks / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        q[r0:r1] = scaled.view(padded.shape)[:r1 - r0, :cols].to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK, *,
                         dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                         chunk_rows: int = 32) -> torch.Tensor:
    """``w = q * scale_inv`` per block (fp32 product, then ``dtype``), stripe by stripe.

    Args:
        q: ``[R, C]`` ``float8_e4m3fn``.
        scale_inv: ``[ceil(R / bn), ceil(C / bk)]`` float (fp32 in checkpoints).
        block: ``(bn, bk)``.
        dtype: result dtype (ignored when ``out`` is given).
        out: optional ``[R, C]`` tensor to write into.
        chunk_rows: block rows per stripe.

    Returns:
        ``[R, C]`` tensor of ``dtype`` (``out`` when given).

    Raises:
        ValueError: ``q`` not 2-D / not e4m3, or ``scale_inv`` (or ``out``) of the wrong shape.
    """
    _check_2d(q, "dequantize_blockwise")
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_blockwise: expected float8_e4m3fn, got {q.dtype}")
    bn, bk = block
    rows, cols = q.shape
    nb_r, nb_c = -(-rows // bn), -(-cols // bk)
    if tuple(scale_inv.shape) != (nb_r, nb_c):
        raise ValueError(f"dequantize_blockwise: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{(rows, cols)} with block {tuple(block)} (expected {(nb_r, nb_c)})")
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    elif tuple(out.shape) != (rows, cols):
        raise ValueError(f"dequantize_blockwise: out shape {tuple(out.shape)} != {(rows, cols)}")
    for b0 in range(0, nb_r, chunk_rows):
        b1 = min(b0 + chunk_rows, nb_r)
        r0, r1 = b0 * bn, min(b1 * bn, rows)
        scale = scale_inv[b0:b1].float().repeat_interleave(bn, 0)[:r1 - r0].repeat_interleave(bk, 1)[:, :cols]
        out[r0:r1] = (q[r0:r1].float() * scale).to(out.dtype)
    return out
