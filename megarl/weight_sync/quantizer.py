"""The sender's FP8 step: a converted bucket quantised to the engines' block-FP8 checkpoint format.

What goes on the wire, and why, is :mod:`megarl.weight_sync.fp8_wire`'s docstring; this module is
the step between conversion and transport that produces it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator, Optional

import torch

from megarl.models.fp8_blocks import BlockFP8, quantize_blockwise, scale_name
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.specs import torch_dtype


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

    def __call__(self, bucket: Bucket, tensors: list[tuple[str, torch.Tensor]],
                 flat: torch.Tensor) -> tuple[Bucket, list[tuple[str, torch.Tensor]], torch.Tensor]:
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
