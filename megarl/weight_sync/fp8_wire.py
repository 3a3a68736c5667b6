"""FP8 on the wire: the sender quantises to the engines' block-FP8 checkpoint format before sending.

When the served checkpoint is block-wise FP8 (its ``config.json`` has ``quantization_config`` =
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}``, as DeepSeek-V3's
and Qwen3's FP8 releases), SGLang holds every quantised linear as a ``float8_e4m3fn`` ``weight``
and a float32 ``weight_scale_inv`` and loads updates in that format. The plan then carries, per
bucket, the tensors the engines receive (:attr:`~megarl.weight_sync.plan.Bucket.wire_tensors`,
from :func:`wire_specs`): each quantised HF weight becomes its FP8 tensor plus its
``<name>_scale_inv`` (:mod:`megarl.models.fp8_blocks`), the rest is unchanged. The stage sender
converts a bucket to BF16 HF tensors as always, then
:class:`~megarl.weight_sync.quantizer.WireQuantizer` quantises it into a
wire bucket (about half the bytes of the quantised weights: 1 byte per element plus 4 per 128 x 128
block), which every transport sends as it is. Engine rank ``r`` receives the FP8 rows/columns of
its slice and the scale blocks of that slice (:func:`~megarl.weight_sync.engine_slices.engine_slices`);
SGLang shards ``weight_scale_inv`` in whole blocks along the weight's split, so this equals the
rank's own shard quantised. The plan is checked against the served checkpoint's headers as before
(FP8 dtypes and every ``_scale_inv`` included).

Which tensors: :meth:`~megarl.models.fp8_blocks.BlockFP8.is_quantized` (SGLang 0.5.23's rule:
decoder linears, not norms, embeddings, LM head, MoE router, nor ``modules_to_not_convert``).

Where it is tested: on CPU, the bytes that cross the wire for quantised tensors (~0.5x) and the
tensors each engine rank's receiver would hand SGLang's loader (names, dtypes, values: equal to an
independent per-block quantisation of its slice). SGLang 0.5.23's CPU backend runs FP8 linears only
with Intel AMX and the ``sgl_kernel`` CPU build (``Fp8LinearMethod.process_weights_after_loading``
asserts ``cpu_has_amx_support()``); this machine has neither, so a CPU engine serves the checkpoint's
dequantisation and its receiver dequantises each FP8 slice before loading
(:mod:`megarl.rollout.dequantized_view`): the DeepSeek-V3 and Kimi-K2 recipes' CPU twins sync this wire
format end to end (``--cpu-scale``, tiny block-FP8 checkpoints). **Not tested on CPU: SGLang's FP8
linears loading them.** On GPU, SGLang may
re-process FP8 weights after loading (DeepGEMM UE8M0 scale requantisation on some GPUs) and fuses
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa``; whether its update path redoes that for
in-place updates is for a GPU run to show.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import metadata

from megarl.models.fp8_blocks import BlockFP8, parse_quantization_config, scale_name
from megarl.weight_sync.specs import HFTensorSpec

FP8_DTYPE = "float8_e4m3fn"
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
"""Releases whose block-FP8 loading (``weight_scale_inv`` names, block-wise TP sharding of the
scales, which layers are quantised) this module was written against."""


def served_quantization(hf_config, *, source: str = "config.json") -> BlockFP8 | None:
    """The engines' block-FP8 settings from their checkpoint's config, None when not quantised.

    Raises:
        ValueError: a ``quantization_config`` other than dynamic block-wise e4m3 (names the field).
        RuntimeError: FP8 served by an installed SGLang other than :data:`SUPPORTED_SGLANG_VERSIONS`.
    """
    quantization = parse_quantization_config(getattr(hf_config, "quantization_config", None),
                                             where=f"{source} quantization_config")
    if quantization is not None:
        check_sglang_version()
    return quantization


def check_sglang_version(version: str | None = None) -> None:
    """Refuse FP8 on the wire with an SGLang release this layout was not checked against.

    Args:
        version: the engines' SGLang version; default: the installed one (no check without one).

    Raises:
        RuntimeError: an unsupported version (names it and what to re-check).
    """
    if version is None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(f"FP8 weight sync (megarl.weight_sync.fp8_wire) was written for SGLang "
                           f"{SUPPORTED_SGLANG_VERSIONS}, found {version}: re-check Fp8Config / "
                           f"BlockQuantScaleParameter loading and update SUPPORTED_SGLANG_VERSIONS")


def wire_specs(hf_tensors: Sequence[HFTensorSpec], quantization: BlockFP8) -> tuple[HFTensorSpec, ...]:
    """The tensors the engines receive for one bucket's HF tensors, in wire order (decreasing
    element size: fp32 scales, then unquantised tensors, then FP8 weights, so every view is aligned).
    """
    out = []
    for t in hf_tensors:
        if not quantization.is_quantized(t.name, t.shape):
            out.append(t)
            continue
        weight = dataclasses.replace(t, dtype=FP8_DTYPE)
        out.append(weight)
        out.append(HFTensorSpec(scale_name(t.name), quantization.scale_shape(t.shape), "float32", t.engine_split,
                                t.expert, t.head_dim, scale_of=weight, block=quantization.block))
    return tuple(sorted(out, key=lambda t: -t.itemsize))


def quantize_listed(slices: Sequence, tensors: Sequence, quantize: Sequence) -> tuple:
    """An engine rank's receiver quantising the tensors owner senders sent unquantised
    (:func:`megarl.weight_sync.senders.receiver_quantized`): each listed ``[j, bn, bk]`` slice
    becomes its ``float8_e4m3fn`` weight and ``<name>_scale_inv`` (``quantize_blockwise``, the
    sender's own quantiser: the bytes of the whole tensor quantised, since the engine rank's slice
    is whole blocks), the rest is kept.

    Args:
        slices: each listed tensor's assembled slice (HF dtype); tensors: the ticket's
            ``[[name, dtype, shape, ...]]``; quantize: the ticket's ``quantize``.

    Returns:
        ``(buffer, tensors)``: ``[nbytes]`` uint8 of the tensors back to back in decreasing element
        size, and their ``[[name, dtype, shape]]``.
    """
    import torch

    from megarl.models.fp8_blocks import quantize_blockwise

    blocks = {int(j): (int(bn), int(bk)) for j, bn, bk in quantize}
    out = []
    for j, (entry, tensor) in enumerate(zip(tensors, slices)):
        if j in blocks:
            q, scale = quantize_blockwise(tensor, blocks[j])
            out += [(entry[0], FP8_DTYPE, q), (scale_name(entry[0]), "float32", scale)]
        else:
            out.append((entry[0], entry[1], tensor))
    out.sort(key=lambda x: -x[2].element_size())
    buffer = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, _, t in out])
    return buffer, [[name, dtype, list(t.shape)] for name, dtype, t in out]
