"""Conversion between packed ``[T_total]`` token streams and padded ``[B, T]`` batches.

The losses in `megarl.algorithms.losses` take padded ``[B, T]`` tensors. A trainer that runs the
model on packed sequences (``cu_seqlens`` boundaries, as Megatron's THD layout) converts its
per-token tensors with `padded_from_packed`; the conversion is differentiable, so the loss of the
padded batch has exactly the packed tokens' gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padded_from_packed(values: Tensor, cu_seqlens: Tensor, *, pad_value: float = 0.0) -> Tensor:
    """Scatter a packed token stream into a right-padded ``[B, T_max]`` batch.

    Args:
        values: ``[T_total]`` (any dtype), sequence ``i`` occupying
            ``values[cu_seqlens[i]:cu_seqlens[i + 1]]``.
        cu_seqlens: ``[B + 1]`` int, cumulative sequence lengths starting at 0 and ending at
            ``T_total`` (non-decreasing; empty sequences allowed).
        pad_value: value written to padding positions.

    Returns:
        ``[B, T_max]`` with ``T_max`` the longest sequence (at least 1), same dtype and device as
        ``values``; differentiable in ``values``.

    Raises:
        ValueError: if ``cu_seqlens`` is not a valid boundary vector for ``values``.
    """
    if values.dim() != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"values must be [T_total] and cu_seqlens [B + 1], got {tuple(values.shape)}, {tuple(cu_seqlens.shape)}"
        )
    cu_seqlens = cu_seqlens.to(device=values.device, dtype=torch.long)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != values.shape[0] or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T_total={values.shape[0]}, got {cu_seqlens.tolist()}")
    num_seqs = lengths.shape[0]
    max_len = max(int(lengths.max()) if num_seqs else 0, 1)
    seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=values.device), lengths)
    position = torch.arange(values.shape[0], device=values.device) - cu_seqlens[:-1][seq_index]
    padded = torch.full((num_seqs, max_len), pad_value, dtype=values.dtype, device=values.device)
    return padded.index_put((seq_index, position), values)
