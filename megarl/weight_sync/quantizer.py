"""The sender's FP8 step: a converted bucket quantised to the engines' block-FP8 checkpoint format.

What goes on the wire, and why, is :mod:`megarl.weight_sync.fp8_wire`'s docstring; this module is
the step between conversion and transport that produces it.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator

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

    def __init__(self, quantization: BlockFP8, ring: list | None = None) -> None:
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


def rows_amax(rows: torch.Tensor, start: int, block) -> torch.Tensor:
    """The part of each scale block's amax that rows ``[start, start + R)`` of a weight hold.

    An owner sender holding only some rows of a block-FP8 weight (a trainer TP shard off the block
    boundaries: MLA's ``q_a_proj`` 1536 / TP8 = 192 rows) computes this, the holders of a block
    shared with a neighbour take the max of their parts (:func:`quantize_rows`' ``amax``), and each
    quantises its own rows: the same bytes as quantising the gathered weight.

    Args:
        rows: ``[R, C]`` float rows of the weight, global rows ``[start, start + R)``.
        start: the first row's index in the weight.
        block: ``(bn, bk)``.

    Returns:
        ``[nb, ceil(C / bk)]`` float32: the blocks ``start // bn .. (start + R - 1) // bn``.
    """
    bn, bk = block
    first, cols = start // bn, rows.shape[1]
    nb, nb_c = (start + rows.shape[0] - 1) // bn - first + 1, -(-cols // bk)
    padded = torch.zeros(nb * bn, nb_c * bk, dtype=torch.float32, device=rows.device)
    padded[start - first * bn:start - first * bn + rows.shape[0], :cols] = rows.float().abs()
    return padded.view(nb, bn, nb_c, bk).amax(dim=(1, 3))


def quantize_rows(rows: torch.Tensor, start: int, block, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[start, start + R)`` of a weight to block FP8 with the blocks' whole amax.

    Args:
        rows: ``[R, C]`` float rows; start, block: as :func:`rows_amax`.
        amax: ``[nb, ceil(C / bk)]`` each touched block's amax over all its rows (the max of its
            holders' :func:`rows_amax`).

    Returns:
        ``(q [R, C] float8_e4m3fn, scale_inv [nb, ceil(C / bk)] float32)``; equal to the
        corresponding rows / blocks of ``quantize_blockwise`` of the whole weight. A column shard
        (a row-parallel ``o_proj`` / ``down_proj``): the same on ``rows.T`` with the block
        ``(bk, bn)``, then transposed back.
    """
    from megarl.models.fp8_blocks import _ZERO_AMAX, E4M3_MAX

    bn, bk = block
    scale = amax.clamp(min=_ZERO_AMAX) / E4M3_MAX
    row_block = (torch.arange(start, start + rows.shape[0], device=rows.device) // bn) - start // bn
    per = scale[row_block].repeat_interleave(bk, dim=1)[:, :rows.shape[1]]
    return (rows.float() / per).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
