"""Metrics that carry their own reduction.

Every function in `megarl.algorithms` returns its metrics as ``dict[str, Metric]`` with keys in
``section/name`` form (``loss/clip_frac_low``, ``mismatch/token_prob_ratio_error``). A `Metric` is
computed on one micro batch of one data-parallel rank; it records how to combine it with the same
metric from other micro batches and ranks so that the combined value equals the value computed on
the whole global batch at once:

- ``"mean"``: ``value`` is a mean over ``weight`` items (tokens or sequences, as the docstring of
  the producing function says). Combine as ``sum(value * weight) / sum(weight)``. Across
  data-parallel ranks: all-reduce (SUM) ``value * weight`` and ``weight``, then divide.
- ``"sum"``: combine by summing (all-reduce SUM). Used for losses that are already divided by the
  global denominators (see `megarl.algorithms.aggregation`), whose sum over micro batches and
  ranks is the whole-batch loss.
- ``"max"`` / ``"min"``: combine with max / min (all-reduce MAX / MIN). A micro batch with no
  items reports ``-inf`` / ``+inf`` (the identity of the reduction).

`reduce_metrics` does the micro-batch combination on one rank and is the reference for what the
data-parallel all-reduce must compute. The optimizer steps of one RL step report the plain mean of
their already reduced values (`mean_over_steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["mean", "sum", "max", "min"]
_REDUCTIONS = ("mean", "sum", "max", "min")


@dataclasses.dataclass(frozen=True, slots=True)
class Metric:
    """One scalar metric and how to reduce it across micro batches and ranks.

    Attributes:
        value: 0-dim tensor, detached from autograd.
        reduction: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` (see the module docstring).
        weight: 0-dim tensor, the number of items (tokens or sequences) the mean runs over; only
            meaningful for ``"mean"`` (``1`` for the other reductions). A mean over zero items has
            ``value`` 0 and ``weight`` 0.
    """

    value: Tensor
    reduction: Reduction
    weight: Tensor

    def __post_init__(self) -> None:
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"Metric.reduction must be one of {_REDUCTIONS}, got {self.reduction!r}")


def mean_metric(values: Tensor, mask: Tensor) -> Metric:
    """Masked mean of ``values`` as a ``"mean"`` `Metric` weighted by the number of masked items.

    Args:
        values: any shape, float.
        mask: same shape as ``values``; nonzero = include. Positions outside the mask may hold
            any value, including ``inf`` or ``nan``.

    Returns:
        A `Metric` with ``weight = count_nonzero(mask)``.
    """
    keep = mask != 0
    values = values.detach()
    count = keep.sum().to(values.dtype)
    total = torch.where(keep, values, torch.zeros_like(values)).sum()
    return Metric(total / count.clamp(min=1), "mean", count)


def extreme_metric(values: Tensor, mask: Tensor, reduction: Literal["max", "min"]) -> Metric:
    """Masked max or min of ``values``; ``-inf`` / ``+inf`` when the mask is empty.

    Args:
        values: any shape, float.
        mask: same shape as ``values``; nonzero = include.
        reduction: ``"max"`` or ``"min"``.
    """
    values = values.detach()
    fill = float("-inf") if reduction == "max" else float("inf")
    filled = torch.where(mask != 0, values, torch.full_like(values, fill))
    if filled.numel() == 0:
        value = torch.tensor(fill, dtype=values.dtype, device=values.device)
    else:
        value = filled.max() if reduction == "max" else filled.min()
    return Metric(value, reduction, torch.ones((), dtype=values.dtype, device=values.device))


def sum_metric(value: Tensor) -> Metric:
    """A ``"sum"`` `Metric` (e.g. a loss already divided by global denominators)."""
    value = value.detach()
    return Metric(value, "sum", torch.ones((), dtype=value.dtype, device=value.device))


def reduce_metrics(metric_dicts: Iterable[Mapping[str, Metric]]) -> dict[str, Metric]:
    """Combine the metrics of several micro batches as if computed on their union.

    Args:
        metric_dicts: one ``dict[str, Metric]`` per micro batch; a key may be missing from some.

    Returns:
        ``dict[str, Metric]`` with one combined `Metric` per key.

    Raises:
        ValueError: if one key is recorded with two different reductions.
    """
    grouped: dict[str, list[Metric]] = {}
    for metrics in metric_dicts:
        for name, metric in metrics.items():
            grouped.setdefault(name, []).append(metric)
    combined: dict[str, Metric] = {}
    for name, items in grouped.items():
        reduction = items[0].reduction
        if any(item.reduction != reduction for item in items):
            raise ValueError(f"metric {name!r} recorded with different reductions")
        values = torch.stack([item.value for item in items])
        weights = torch.stack([item.weight for item in items])
        if reduction == "mean":
            total_weight = weights.sum()
            value = (values * weights).sum() / total_weight.clamp(min=1)
            combined[name] = Metric(value, "mean", total_weight)
        elif reduction == "sum":
            combined[name] = Metric(values.sum(), "sum", weights[0])
        else:
            value = values.max() if reduction == "max" else values.min()
            combined[name] = Metric(value, reduction, weights[0])
    return combined


def mean_over_steps(per_step: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average the metrics of several optimizer steps of one RL step (each already reduced over its
    micro batches and ranks); a key missing in some steps is averaged over those present.
    ``train/num_optimizer_steps`` counts the steps."""
    keys = {k for m in per_step for k in m}
    out = {k: float(sum(m[k] for m in per_step if k in m) / sum(k in m for m in per_step)) for k in keys}
    out["train/num_optimizer_steps"] = float(len(per_step))
    return out
