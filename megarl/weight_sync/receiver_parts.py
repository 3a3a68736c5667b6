"""Where the parts of an owner-sender bucket entry go in an engine rank's slices, and their check
(:mod:`megarl.weight_sync.owners`; the receiver's side, :mod:`megarl.weight_sync.receiver`, pure
functions of the ticket and the received bytes)."""
from __future__ import annotations

import torch

from megarl.weight_sync import wire


def part_targets(buffer: torch.Tensor, ticket: dict) -> tuple[list, list]:
    """Where each part of an owner-sender bucket entry goes: ``(slices, placed)``.

    Args:
        buffer: ``[nbytes]`` uint8, the engine rank's slices back to back (the entry's ``tensors``).
        ticket: the bucket entry (``tensors`` ``[[name, dtype, shape, ...]]``, ``parts``
            ``[[source, tensor index, axis, offset, shape]]``, :mod:`megarl.weight_sync.owners`).

    Returns:
        ``slices``: each tensor's view of ``buffer``; ``placed``: per part in arrival order
        ``(source, tensor index, target, into, k)``: ``target`` the part's place in its slice,
        ``into`` what receives its bytes (``target`` itself where contiguous, else a temporary of
        the part's shape), ``k`` its position among its source's parts (its checksum's).
    """
    from megarl.weight_sync.specs import torch_dtype

    slices, offset = [], 0
    for _name, dtype, shape in (entry[:3] for entry in ticket["tensors"]):
        n = torch.Size(shape).numel() * torch_dtype(dtype).itemsize
        slices.append(buffer[offset:offset + n].view(torch_dtype(dtype)).view(shape))
        offset += n
    placed: list[tuple] = []
    counts: dict[int, int] = {}
    for source, j, axis, at, shape in ticket["parts"]:
        target = slices[j].narrow(axis, at, shape[axis])
        into = target if target.is_contiguous() else torch.empty(shape, dtype=target.dtype, device=buffer.device)
        placed.append((int(source), j, target, into, counts.get(int(source), 0)))
        counts[int(source)] = counts.get(int(source), 0) + 1
    return slices, placed


def place_parts(placed: list, sums: dict, slices: list, algo: str) -> tuple[int, int]:
    """Check each received part against its sender's checksum and put the strided ones into their
    slice: ``(status, tensor index)`` (1: a part's checksum differs; 5: the parts do not fill a slice)."""
    filled = [0] * len(slices)
    for source, j, target, into, k in placed:
        if wire.checksum(into, algo) != sums[source][k]:
            return 1, j
        if into is not target:
            target.copy_(into)
        filled[j] += into.numel()
    bad = next((j for j, (n, sl) in enumerate(zip(filled, slices)) if n != sl.numel()), None)
    return (5, bad) if bad is not None else (0, 0)
