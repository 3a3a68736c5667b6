"""FP8 on the wire: the sender quantises to the engines' block-FP8 checkpoint format before sending.

When the served checkpoint is block-wise FP8 (its ``config.json`` has ``quantization_config`` =
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}``, as DeepSeek-V3's
and Qwen3's FP8 releases), SGLang holds every quantised linear as a ``float8_e4m3fn`` ``weight``
and a float32 ``weight_scale_inv`` and loads updates in that format. The plan then carries, per
bucket, the tensors the engines receive (:attr:`~megarl.weight_sync.plan.Bucket.wire_tensors`,
from :func:`wire_specs`): each quantised HF weight becomes its FP8 tensor plus its
``<name>_scale_inv`` (:mod:`megarl.models.fp8_blocks`), the rest is unchanged. The stage sender
converts a bucket to BF16 HF tensors as always, then :class:`WireQuantizer` quantises it into a
wire bucket (about half the bytes of the quantised weights: 1 byte per element plus 4 per 128 x 128
block), which every transport sends as it is. Engine rank ``r`` receives the FP8 rows/columns of
its slice and the scale blocks of that slice (:func:`~megarl.weight_sync.plan.engine_slices`);
SGLang shards ``weight_scale_inv`` in whole blocks along the weight's split, so this equals the
rank's own shard quantised. The plan is checked against the served checkpoint's headers as before
(FP8 dtypes and every ``_scale_inv`` included).

Which tensors: :meth:`~megarl.models.fp8_blocks.BlockFP8.is_quantized` (SGLang 0.5.23's rule:
decoder linears, not norms, embeddings, LM head, MoE router, nor ``modules_to_not_convert``).

Where it is tested: on CPU, the bytes that cross the wire for quantised tensors (~0.5x) and the
tensors each engine rank's receiver would hand SGLang's loader (names, dtypes, values: equal to an
independent per-block quantisation of its slice). **Not tested: an SGLang engine loading them.**
SGLang 0.5.23's CPU backend runs FP8 linears only with Intel AMX and the ``sgl_kernel`` CPU build
(``Fp8LinearMethod.process_weights_after_loading`` asserts ``cpu_has_amx_support()``); this
machine has neither, so no CPU SGLang server here can serve an FP8 checkpoint. On GPU, SGLang may
re-process FP8 weights after loading (DeepGEMM UE8M0 scale requantisation on some GPUs) and fuses
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa``; whether its update path redoes that for
in-place updates is for a GPU run to show.
"""
from __future__ import annotations

import dataclasses
import time
from importlib import metadata
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

import torch

from megarl.models.fp8_blocks import BlockFP8, parse_quantization_config, quantize_blockwise, scale_name
from megarl.weight_sync.specs import HFTensorSpec

if TYPE_CHECKING:
    from megarl.weight_sync.plan import Bucket

FP8_DTYPE = "float8_e4m3fn"
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
"""Releases whose block-FP8 loading (``weight_scale_inv`` names, block-wise TP sharding of the
scales, which layers are quantised) this module was written against."""


def served_quantization(hf_config, *, source: str = "config.json") -> Optional[BlockFP8]:
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


def check_sglang_version(version: Optional[str] = None) -> None:
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


class WireQuantizer:
    """The sender's step between conversion and transport for a block-FP8 served checkpoint.

    Args:
        quantization: the served checkpoint's settings.
        ring: buffers to reuse across buckets and syncs (``RING_SLOTS`` entries; bucket ``b`` uses
            slot ``b % RING_SLOTS``, like the gather ring: when bucket ``b`` is quantised the
            transport has finished with ``b - 2``); None: a fresh buffer per bucket.
    """

    def __init__(self, quantization: BlockFP8, ring: Optional[list] = None) -> None:
        self.quantization, self.ring = quantization, ring
        self.quantize_s = 0.0
        """Seconds spent quantising (summed over buckets)."""

    def _buffer(self, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.ring is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        slot = index % len(self.ring)
        buf = self.ring[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.ring[slot] = buf
        return buf[:nbytes]

    def __call__(self, bucket: "Bucket", tensors: list[tuple[str, torch.Tensor]],
                 flat: torch.Tensor) -> tuple["Bucket", list[tuple[str, torch.Tensor]], torch.Tensor]:
        """Quantise one converted bucket.

        Args:
            bucket: a plan bucket with ``wire_tensors``.
            tensors: its HF tensors (wire order of ``hf_tensors``), views of ``flat``.
            flat: ``[bucket.nbytes]`` uint8.

        Returns:
            ``(wire bucket, [(name, view)], wire flat)``: the bucket with ``hf_tensors`` = its wire
            tensors, the engines' tensors as views of ``wire flat`` (``[bucket.wire_nbytes]`` uint8).

        Raises:
            ValueError: a converted tensor does not have its planned name or shape.
        """
        from megarl.weight_sync.segments import torch_dtype

        started = time.perf_counter()
        wire = bucket.wire
        out = self._buffer(bucket.index, sum(t.nbytes for t in wire), flat.device)
        views, offset = {}, 0
        for t in wire:
            views[t.name] = out[offset:offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape)
            offset += t.nbytes
        block = self.quantization.block
        for name, tensor in tensors:
            target = views.get(name)
            if target is None or tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: converted {tuple(tensor.shape)} is not a planned wire tensor "
                                 f"({None if target is None else tuple(target.shape)})")
            if target.dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
                q, scale_inv = quantize_blockwise(tensor, block)
                target.copy_(q)
                views[scale_name(name)].copy_(scale_inv)
            else:
                target.copy_(tensor)
        self.quantize_s += time.perf_counter() - started
        wire_bucket = dataclasses.replace(bucket, hf_tensors=wire, wire_tensors=())
        return wire_bucket, [(t.name, views[t.name]) for t in wire], out

    def wrap(self, buckets: Iterable[tuple]) -> Iterator[tuple]:
        """:meth:`__call__` over ``(bucket, tensors, flat)`` items, lazily (conversion of the next
        bucket still overlaps the transfer of this one)."""
        for bucket, tensors, flat in buckets:
            yield self(bucket, tensors, flat)
