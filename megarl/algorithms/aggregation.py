"""Loss aggregation: from per-token losses ``[B, T]`` to one scalar, split-invariant.

Every policy loss in `megarl.algorithms.losses` builds a per-token loss matrix ``l[i, t]`` and
reduces it here. Sequence-level losses (GSPO's ``l_i``) are broadcast to every loss token of their
sequence first, so one set of rules covers both. With ``m`` the loss mask, ``n_i = sum_t m[i, t]``
the loss tokens of sequence ``i``, and the denominators taken over the **global batch** (every
micro batch of one optimizer step on every data-parallel rank):

=========================== ================================================== =====================
mode                        loss                                               sequence-level l_i
=========================== ================================================== =====================
``token_mean``              ``sum_{i,t} m l / N_tokens``                       ``sum_i n_i l_i / N_tokens``
``seq_mean_token_mean``     ``sum_i (sum_t m l / n_i) / N_seqs``               ``sum_i l_i / N_seqs``
``seq_mean_token_sum``      ``sum_i sum_t m l / N_seqs``                       ``sum_i n_i l_i / N_seqs``
``seq_mean_token_sum_norm`` ``sum_i sum_t m l / (N_seqs * L_max)``             ``sum_i n_i l_i / (N_seqs L_max)``
=========================== ================================================== =====================

``N_tokens`` is the number of loss tokens, ``N_seqs`` the number of sequences with at least one loss
token (a fully masked sequence is not counted and contributes nothing), and ``L_max`` a constant
(Dr.GRPO's generation budget, e.g. the configured maximum response length). ``seq_mean_token_mean``
is the GRPO/GSPO papers' ``1/G sum_i 1/|y_i| sum_t``; ``token_mean`` is DAPO's; ``seq_mean_token_sum``
and ``seq_mean_token_sum_norm`` are Dr.GRPO's (Liu et al. 2025, arXiv:2503.20783). Deviation from
verl: its ``seq-mean-token-sum-norm`` divides by ``L_max`` only (no ``1/N_seqs``), which is ``N_seqs``
times larger; ours is the mean over sequences of ``token_sum / L_max``.

How the trainer must use it (the split-invariance contract):

1. Before the first micro batch of an optimizer step, count the global denominators: for every
   micro batch ``LossNormalizer.from_loss_mask(mb.loss_mask, max_response_tokens=L_max)``, sum them
   over the micro batches (``+``), then all-reduce ``num_tokens`` and ``num_seqs`` with SUM over the
   data-parallel group. Use the loss mask the loss will see (after any masked-IS correction).
2. Pass that one global `LossNormalizer` to the loss of **every** micro batch on every rank.
3. Gradients are **summed**: ``backward()`` on each micro batch loss accumulates (a sum) and the
   data-parallel gradient reduction must be a SUM, not an average. Then the summed loss and the
   summed gradient equal those of the whole global batch computed at once (tested in float64).
   Megatron-Core 0.16 (2-tuple ``loss_func``, ``calculate_per_token_loss=False``,
   ``context_parallel_size=1``) divides each micro-batch loss by ``num_microbatches`` and scales
   gradients by ``1/dp_size`` before its data-parallel sum, so ``loss_func`` must return
   ``loss * num_microbatches * dp_size`` to obtain the sum.
4. A sequence must not be split across micro batches or ranks (context parallelism must gather a
   sequence's logprobs before calling the loss): ``n_i`` and GSPO's sequence ratio are per row.

Without a normalizer, the denominators are counted from the given ``loss_mask`` (and ``L_max`` is
its padded width ``T``): correct for a single whole batch only.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LossNormalizer:
    """Global loss denominators of one optimizer step (all micro batches, all data-parallel ranks).

    Attributes:
        num_tokens: number of loss tokens (``loss_mask == 1``), float or 0-dim tensor.
        num_seqs: number of sequences with at least one loss token, float or 0-dim tensor.
        max_response_tokens: ``L_max`` of ``seq_mean_token_sum_norm``, a constant in tokens (e.g.
            the maximum response length); None uses the padded width ``T`` of the loss input,
            which is only split-invariant if every micro batch has the same ``T``.
    """

    num_tokens: float | Tensor
    num_seqs: float | Tensor
    max_response_tokens: float | None = None

    @classmethod
    def from_loss_mask(cls, loss_mask: Tensor, *, max_response_tokens: float | None = None) -> LossNormalizer:
        """Count the local denominators of one micro batch.

        Args:
            loss_mask: ``[B, T]``, bool or {0, 1} float; 1 = trained token.
            max_response_tokens: see the class attribute.

        Returns:
            A `LossNormalizer` with ``num_tokens`` and ``num_seqs`` as float64 0-dim tensors on
            ``loss_mask``'s device; sum these over micro batches and all-reduce (SUM) over DP.
        """
        _check_mask(loss_mask)
        seq_tokens = (loss_mask != 0).sum(dim=-1)
        return cls(
            num_tokens=seq_tokens.sum().to(torch.float64),
            num_seqs=(seq_tokens > 0).sum().to(torch.float64),
            max_response_tokens=max_response_tokens,
        )

    def __add__(self, other: LossNormalizer) -> LossNormalizer:
        if self.max_response_tokens != other.max_response_tokens:
            raise ValueError("cannot add LossNormalizers with different max_response_tokens")
        return LossNormalizer(
            num_tokens=self.num_tokens + other.num_tokens,
            num_seqs=self.num_seqs + other.num_seqs,
            max_response_tokens=self.max_response_tokens,
        )


def _check_mask(loss_mask: Tensor) -> None:
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")


def _denominator(value: float | Tensor, like: Tensor) -> Tensor:
    """A positive denominator: counts of 0 become 1 (the numerator is then 0 as well)."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1)


def aggregate_loss(
    token_losses: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    normalizer: LossNormalizer | None = None,
) -> Tensor:
    """Reduce a per-token loss matrix to the scalar loss of this micro batch.

    Args:
        token_losses: ``[B, T]`` float, loss of each token (a sequence-level loss broadcast over
            its tokens). Values outside ``loss_mask`` are ignored, even ``inf`` / ``nan``.
        loss_mask: ``[B, T]`` bool or {0, 1} float; 1 = trained token, 0 = prompt, tool output
            or padding.
        loss_agg_mode: one of `LOSS_AGG_MODES` (formulas in the module docstring).
        normalizer: global denominators; None counts them from ``loss_mask`` (whole batch only).

    Returns:
        0-dim tensor, this micro batch's share of the global-batch loss: summing it over micro
        batches and data-parallel ranks gives the global-batch loss.

    Raises:
        ValueError: on an unknown ``loss_agg_mode`` or mismatched shapes.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    _check_mask(loss_mask)
    if token_losses.shape != loss_mask.shape:
        raise ValueError(
            f"token_losses shape {tuple(token_losses.shape)} != loss_mask shape {tuple(loss_mask.shape)}"
        )
    if normalizer is None:
        normalizer = LossNormalizer.from_loss_mask(loss_mask)
    keep = loss_mask != 0
    # where(), not a product: padding may hold inf/nan and 0 * inf = nan.
    masked = torch.where(keep, token_losses, torch.zeros_like(token_losses))
    if loss_agg_mode == "token_mean":
        return masked.sum() / _denominator(normalizer.num_tokens, masked)
    seq_sums = masked.sum(dim=-1)
    num_seqs = _denominator(normalizer.num_seqs, masked)
    if loss_agg_mode == "seq_mean_token_mean":
        seq_tokens = keep.sum(dim=-1).to(masked.dtype).clamp(min=1)
        return (seq_sums / seq_tokens).sum() / num_seqs
    if loss_agg_mode == "seq_mean_token_sum":
        return seq_sums.sum() / num_seqs
    max_tokens = normalizer.max_response_tokens
    if max_tokens is None:
        max_tokens = loss_mask.shape[-1]
    if max_tokens <= 0:
        raise ValueError(f"max_response_tokens must be > 0, got {max_tokens}")
    return seq_sums.sum() / (num_seqs * max_tokens)
