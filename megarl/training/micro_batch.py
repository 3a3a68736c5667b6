"""The tensors of one packed micro batch: ``R`` rows of ``S`` tokens (see `megarl.training.batching`).

Orders used below:

- **flat** (row-major): position ``r * S + s`` of the ``[R, S]`` rows; ``gather`` returns a
  `TrainBatch` field in this order, padding filled.
- **real**: the micro batch's real tokens in flat order; sequences are contiguous in it
  (``cu_seqlens``), and ``token_index`` maps them to the `TrainBatch`'s packed fields.
- **router** (Megatron's ``[S, R, H]`` hidden-state order, sequence-major): what a MoE router on
  this rank sees, after the sequence-parallel split of ``S`` over TP ranks; `router_positions`
  maps it to flat positions.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from megarl.training.batch import TrainBatch
from megarl.training.batching import MicroBatchSpec


@dataclasses.dataclass(kw_only=True)
class PackedMicroBatch:
    """One micro batch as model inputs.

    Attributes:
        spec: the plan entry it was built from.
        input_ids: ``[R, S]`` int64; padding ids are 0.
        position_ids: ``[R, S]`` int64 position within each sequence (row padding keeps counting).
        attention_mask: ``[R, 1, S, S]`` bool, True = masked (causal within each sequence), or
            None when ``packed_seq_params`` is used.
        packed_seq_params: Megatron ``PackedSeqParams`` (THD, ``R = 1``) for Transformer Engine, or None.
        cu_seqlens: ``[N + 1]`` int64 boundaries of the N sequences in the real order.
        flat_index: ``[T_real]`` int64 flat positions of the real tokens.
        token_index: ``[T_real]`` int64 positions of the real tokens in the `TrainBatch` fields.
    """

    spec: MicroBatchSpec
    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    packed_seq_params: Any | None
    cu_seqlens: Tensor
    flat_index: Tensor
    token_index: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, S)``."""
        return self.input_ids.shape[0], self.input_ids.shape[1]

    @property
    def flat_size(self) -> int:
        """``R * S``: the flat positions (the size of `gather`'s output)."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        """A copy with every tensor (and the THD ``cu_seqlens``) on ``device``."""
        if self.input_ids.device == torch.device(device):
            return self
        packed = self.packed_seq_params
        if packed is not None:
            packed = dataclasses.replace(packed, cu_seqlens_q=packed.cu_seqlens_q.to(device),
                                         cu_seqlens_kv=packed.cu_seqlens_kv.to(device))
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return PackedMicroBatch(**{**moved, "packed_seq_params": packed})

    def gather(self, values: Tensor, pad_value: float = 0) -> Tensor:
        """``[R * S, ...]`` flat view of a `TrainBatch` per-token field ``values [T_total, ...]``
        (on the device of ``values``)."""
        out = torch.full((self.input_ids.numel(), *values.shape[1:]), pad_value, dtype=values.dtype,
                         device=values.device)
        out[self.flat_index.to(values.device)] = values[self.token_index.to(values.device)]
        return out

    def router_positions(self, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False) -> Tensor:
        """``[S' * R]`` flat positions of the tokens a router on this rank sees, in its order.

        ``S' = S / tp_size`` under sequence parallelism (TP rank ``r`` holds rows ``s`` in
        ``[r S', (r + 1) S')``), else ``S``.
        """
        rows, length = self.shape
        positions = torch.arange(rows * length, device=self.input_ids.device).view(rows, length).t()  # [S, R]
        if sequence_parallel and tp_size > 1:
            positions = positions.chunk(tp_size)[tp_rank]
        return positions.reshape(-1)


SEGMENTS_ATTRIBUTE = "_megarl_block_causal_segments"
"""Attribute of a mask from `block_causal_mask`: ``(per-row segment lengths, mask._version)``."""


def block_causal_mask(row_segments: list[list[int]], length: int) -> Tensor:
    """``[R, 1, S, S]`` bool mask (True = masked) of rows packed with sequences attending causally to themselves.

    Args:
        row_segments: per row, the lengths of its consecutive segments (sequences, and the row's
            padding as a last segment); each row's lengths sum to ``length``.
        length: ``S``, the row length.

    Returns:
        The mask, with the segments remembered for ``megarl.training.local_attention.LocalSDPAttention``.

    Raises:
        ValueError: a row's segments do not sum to ``length``.
    """
    mask = torch.ones(len(row_segments), 1, length, length, dtype=torch.bool)
    for r, lens in enumerate(row_segments):
        if sum(lens) != length or min(lens, default=1) <= 0:
            raise ValueError(f"row {r}: segment lengths {lens} must be positive and sum to the row length {length}")
        start = 0
        for n in lens:  # only the diagonal blocks are written (~17x faster than comparing sequence ids)
            mask[r, 0, start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).triu(1)
            start += n
    setattr(mask, SEGMENTS_ATTRIBUTE, ([list(lens) for lens in row_segments], mask._version))
    return mask


def pack_micro_batch(batch: TrainBatch, spec: MicroBatchSpec, *,
                     use_packed_seq_params: bool = False) -> PackedMicroBatch:
    """Build the rows of one micro batch.

    Args:
        batch: the step's `TrainBatch`.
        spec: which sequences go in which row, and the row length.
        use_packed_seq_params: THD ``PackedSeqParams`` (Transformer Engine attention; needs one
            row) instead of a dense block-diagonal causal mask (the local spec's attention).

    Raises:
        ValueError: ``use_packed_seq_params`` with more than one row.
    """
    num_rows, length = len(spec.rows), spec.row_length
    if use_packed_seq_params and num_rows != 1:
        raise ValueError(f"THD packed sequences need a single row, the spec has {num_rows}")
    input_ids = torch.zeros(num_rows, length, dtype=torch.int64)
    position_ids = torch.arange(length).repeat(num_rows, 1)
    flat, tokens, lens = [], [], []
    row_lens: list[list[int]] = [[] for _ in spec.rows]
    starts, ends = batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()
    for r, row in enumerate(spec.rows):
        offset = 0
        for i in row:
            n = ends[i] - starts[i]
            input_ids[r, offset:offset + n] = batch.input_ids[starts[i]:ends[i]]
            position_ids[r, offset:offset + n] = torch.arange(n)
            flat.append(torch.arange(r * length + offset, r * length + offset + n))
            tokens.append(torch.arange(starts[i], ends[i]))
            lens.append(n)
            row_lens[r].append(n)
            offset += n
        position_ids[r, offset:] = torch.arange(length - offset)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    empty = torch.zeros(0, dtype=torch.int64)
    attention_mask, packed = None, None
    if use_packed_seq_params:
        from megatron.core.packed_seq_params import PackedSeqParams

        real = int(cu[-1])
        bounds = (torch.cat([cu, torch.tensor([length])]) if length > real else cu).to(torch.int32)
        max_len = int((bounds[1:] - bounds[:-1]).max())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
    else:
        # padding positions form their own "sequence" per row (they attend only to padding); the
        # mask carries the segments, so the local spec's attention runs once per sequence
        attention_mask = block_causal_mask([lens_r + ([length - sum(lens_r)] if sum(lens_r) < length else [])
                                            for lens_r in row_lens], length)
    return PackedMicroBatch(spec=spec, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            packed_seq_params=packed, cu_seqlens=cu,
                            flat_index=torch.cat(flat) if flat else empty,
                            token_index=torch.cat(tokens) if tokens else empty)
