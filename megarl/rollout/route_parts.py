"""R3 routes kept where they were decoded: a trajectory's routes as per-call parts in the object store.

With engine-facing workers (:mod:`megarl.launch.route_workers`), each generate call's routes are
decoded and ``ray.put`` by the worker that talked to the engine; the call's output carries a
:class:`RoutePart` (the reference and the shape) instead of the tensor. The agent loop stitches
parts as it stitches tensors (:func:`concat_routes`; ``shape`` is all it reads), and the trajectory
holds :class:`RouteParts`: the parts in position order and the row count of the whole. The trainer
rank that trains the sequence fetches the parts and builds the ``[P + R, L, K]`` tensor
(:func:`assemble`), so no process on the rollout side holds a step's routes. This module holds no
reference type of its own: a part's ``ref`` is whatever the worker put (a Ray ``ObjectRef``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class RoutePart:
    """One generate call's routes, rows ``[start, start + rows)`` of its trajectory.

    Attributes:
        ref: object-store reference to the ``[rows, L, K]`` int32 tensor.
        shape: ``(rows, L, K)``.
    """

    ref: Any
    shape: tuple[int, int, int]

    def to(self, dtype: torch.dtype) -> RoutePart:
        """Itself: the worker put int32 routes (the agent loop's ``routes.to(torch.int32)``)."""
        if dtype != torch.int32:
            raise TypeError(f"RoutePart holds int32 routes, cannot convert to {dtype}")
        return self


@dataclasses.dataclass(frozen=True)
class RouteParts:
    """A trajectory's routes as parts: rows ``[0, length)`` are the parts concatenated, cut at
    ``length`` (the engine may report more rows than positions kept), ``-1`` beyond their rows (the
    final token, which no forward read).

    Attributes:
        parts: the generate calls' parts in position order.
        length: rows of the whole (``P + R`` once the trajectory is frozen).
    """

    parts: tuple[RoutePart, ...]
    length: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(length, L, K)``."""
        return (self.length, *self.parts[0].shape[1:])

    @property
    def refs(self) -> list[Any]:
        """Every part's reference, in order."""
        return [p.ref for p in self.parts]

    def with_length(self, length: int) -> RouteParts:
        """The same parts, ``length`` rows (cut or padded with -1 when assembled)."""
        return RouteParts(self.parts, int(length))


def concat_routes(known: Any, new: Any) -> Any:
    """``known`` rows followed by ``new`` ones: tensors concatenated, parts appended.

    Raises:
        TypeError: a tensor and a part mixed (every call of a trajectory goes through one client).
    """
    if isinstance(new, RoutePart):
        if known is None:
            return RouteParts((new,), new.shape[0])
        if isinstance(known, RouteParts):
            return RouteParts((*known.parts, new), known.length + new.shape[0])
    elif isinstance(new, torch.Tensor) and (known is None or isinstance(known, torch.Tensor)):
        return new if known is None else torch.cat([known, new])
    raise TypeError(f"cannot stitch routes of type {type(new).__name__} after {type(known).__name__}")


def assemble(routes: RouteParts, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[length, L, K]`` int32 tensor of ``routes`` from its parts' tensors (fetched, in order).

    Raises:
        ValueError: a tensor's shape differs from its part's.
    """
    for part, tensor in zip(routes.parts, tensors, strict=True):
        if tuple(tensor.shape) != tuple(part.shape):
            raise ValueError(f"a route part has shape {tuple(tensor.shape)}, its record says {part.shape}")
    whole = torch.cat([t.to(torch.int32) for t in tensors])[:routes.length]
    out = torch.full(routes.shape, -1, dtype=torch.int32)
    out[:whole.shape[0]] = whole
    return out
