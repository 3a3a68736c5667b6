"""Policy losses: GSPO (default), GSPO-token and PPO-clip (with DAPO clip-higher and dual clip).

Each registers itself in `megarl.algorithms.extensions.POLICY_LOSSES` under its
``algorithm.policy_loss`` name, declaring the ``algorithm`` fields it takes (``clip_low``,
``clip_high``; ``clip_c`` for PPO), its ratio level and, for GSPO, its clip ceiling.

All losses take padded ``[B, T]`` tensors (``B`` sequences, ``T`` padded response length; for packed
``[T_total]`` batches see `megarl.algorithms.packing.padded_from_packed`), build a per-token loss
matrix and reduce it with `megarl.algorithms.aggregation.aggregate_loss` (read its module docstring
for how a trainer splits a batch into micro batches and data-parallel ranks). They return
``(loss, metrics)``: ``loss`` a 0-dim tensor to minimise (the negated objective), ``metrics`` a
``dict[str, Metric]`` (see `megarl.algorithms.metrics`):

- ``loss/policy`` (sum): the loss value.
- ``loss/clip_frac_low`` / ``loss/clip_frac_high`` (mean): fraction of sequences (GSPO) or tokens
  (GSPO-token, PPO) whose clip is *active*: ratio below ``1 - clip_low`` with a negative advantage,
  or above ``1 + clip_high`` with a positive advantage (the gradient is then zero).
- ``loss/importance_ratio_{mean,min,max}`` (PPO, over loss tokens) or
  ``loss/seq_importance_ratio_{mean,min,max}`` (GSPO, GSPO-token, over sequences with a loss token).
- ``loss/approx_kl_old`` (mean over loss tokens): k3 estimate of ``KL(pi_old || pi_theta)``,
  ``(r - 1) - log r`` with ``r = exp(logprobs - old_logprobs)`` (Schulman 2020).
- ``loss/entropy`` (mean over loss tokens) when a per-token ``entropy`` is given.
- ``loss/dual_clip_frac`` (PPO with ``clip_c``, mean over loss tokens).

Shared arguments: ``logprobs`` ``[B, T]`` float (current policy, with grad), ``old_logprobs``
``[B, T]`` (trainer at the sampling-time weights, no grad), ``loss_mask`` ``[B, T]`` bool or
{0, 1} float (1 = trained token; 0 = prompt, tool output, padding; values outside the mask are
ignored, even inf/nan), ``is_weights`` optional ``[B, T]`` detached per-token factor from
`megarl.algorithms.corrections` (rollout correction; sequence-level weights broadcast over tokens),
``entropy`` optional ``[B, T]`` per-token policy entropy (metric only), ``loss_agg_mode`` and
``normalizer`` as in `aggregate_loss`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megarl.algorithms.aggregation import LossNormalizer, aggregate_loss
from megarl.algorithms.extensions import POLICY_LOSSES, register_policy_loss
from megarl.algorithms.metrics import Metric, extreme_metric, mean_metric, sum_metric

PolicyLossOutput = tuple[Tensor, dict[str, Metric]]

GSPO_MAX_CLIP = 0.05
"""The largest clip range GSPO accepts: the paper's are 3e-4 / 4e-4; PPO-sized ranges defeat it."""
CLIPS = {"clip_low": "clip_low", "clip_high": "clip_high"}
"""The clip ranges every built-in loss takes, from the ``algorithm`` fields of the same names."""


def _gspo_clip_issues(keywords: Mapping[str, Any]) -> list[tuple[str, str]]:
    """GSPO clips the sequence-level ratio: clip ranges above :data:`GSPO_MAX_CLIP` are refused."""
    return [(name, f"GSPO clips the sequence-level ratio: use a small positive range (paper: 3e-4 low / "
                   f"4e-4 high), at most {GSPO_MAX_CLIP}; PPO-sized ranges belong to ppo_clip")
            for name in ("clip_low", "clip_high") if keywords[name] > GSPO_MAX_CLIP]


def _check_token_inputs(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Accept per-token ``[B, T]`` or per-sequence ``[B]`` advantages; return ``[B, T]``."""
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages[:, None].expand_as(like)
    raise ValueError(
        f"advantages must be [B, T] or [B], got {tuple(advantages.shape)} for logprobs {tuple(like.shape)}"
    )


def _masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, keep: Tensor) -> Tensor:
    """``logprobs - old_logprobs`` on loss tokens, exactly 0 elsewhere (padding may be inf/nan)."""
    diff = torch.where(keep, logprobs, torch.zeros_like(logprobs)) - torch.where(
        keep, old_logprobs, torch.zeros_like(old_logprobs)
    )
    return diff


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic surrogate as a loss: ``max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``.

    Returns:
        ``(losses, clipped_low, clipped_high)``, all the shape of ``ratio``; the masks are bool and
        mark where the clipped branch is active (its gradient is zero).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return losses, clipped_low, clipped_high


def _apply_is_weights(token_losses: Tensor, is_weights: Tensor | None) -> Tensor:
    if is_weights is None:
        return token_losses
    if is_weights.shape != token_losses.shape:
        raise ValueError(f"is_weights must be [B, T] {tuple(token_losses.shape)}, got {tuple(is_weights.shape)}")
    return token_losses * is_weights.detach()


def _common_metrics(
    loss: Tensor, log_ratio: Tensor, keep: Tensor, entropy: Tensor | None
) -> dict[str, Metric]:
    """``loss/policy``, ``loss/approx_kl_old`` and, if given, ``loss/entropy``."""
    log_ratio = log_ratio.detach()
    metrics = {
        "loss/policy": sum_metric(loss),
        "loss/approx_kl_old": mean_metric(torch.expm1(log_ratio) - log_ratio, keep),
    }
    if entropy is not None:
        if entropy.shape != keep.shape:
            raise ValueError(f"entropy must be [B, T] {tuple(keep.shape)}, got {tuple(entropy.shape)}")
        metrics["loss/entropy"] = mean_metric(entropy, keep)
    return metrics


def _clip_metrics(low: Tensor, high: Tensor, keep: Tensor) -> dict[str, Metric]:
    """Fractions of the items where ``keep`` whose low / high clip is active."""
    return {
        "loss/clip_frac_low": mean_metric(low.to(torch.float64), keep),
        "loss/clip_frac_high": mean_metric(high.to(torch.float64), keep),
    }


def _ratio_metrics(prefix: str, ratio: Tensor, keep: Tensor) -> dict[str, Metric]:
    """Mean/min/max of ``ratio`` over the items where ``keep``."""
    return {
        f"loss/{prefix}_mean": mean_metric(ratio, keep),
        f"loss/{prefix}_min": extreme_metric(ratio, keep, "min"),
        f"loss/{prefix}_max": extreme_metric(ratio, keep, "max"),
    }


def seq_log_importance_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio ``(1/|y_i|) sum_t m_it (logp_it - old_logp_it)``.

    Args:
        logprobs, old_logprobs, loss_mask: ``[B, T]`` (see the module docstring).

    Returns:
        ``[B]``, differentiable in ``logprobs``; 0 for a sequence without loss tokens.
    """
    _check_token_inputs(logprobs, old_logprobs, loss_mask)
    keep = loss_mask != 0
    seq_tokens = keep.sum(dim=-1).to(logprobs.dtype).clamp(min=1)
    return _masked_log_ratio(logprobs, old_logprobs, keep).sum(dim=-1) / seq_tokens


@register_policy_loss("gspo", hyperparameters=CLIPS, ratio_level="sequence", check=_gspo_clip_issues)
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg_mode: str = "seq_mean_token_mean",
    normalizer: LossNormalizer | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """Group Sequence Policy Optimization loss (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7).

    ``s_i = exp((1/|y_i|) sum_t m_it (logp_it - old_logp_it))`` (``seq_importance_ratio``, ``[B]``),
    ``l_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``; the gradient flows through
    the whole length-normalised sum, so unclipped ``grad l_i = -A_i s_i (1/|y_i|) sum_t grad logp_it``.
    ``l_i`` is broadcast to the loss tokens of sequence ``i`` and aggregated: with the default
    ``seq_mean_token_mean`` the loss is ``(1/N_seqs) sum_i l_i``, the paper's eq. 5 (``1/G`` over
    a group becomes ``1/N_seqs`` over the global batch). A sequence without loss tokens has
    ``s_i = 1`` and contributes nothing.

    Defaults are the paper's clip ranges (section 5.1, 3e-4 / 4e-4; peers such as slime default to
    0.2). Deviations from the paper: optional rollout-correction ``is_weights`` multiply each
    token's copy of ``l_i`` (so token-level weights act as their per-sequence aggregate, e.g. the
    mean weight under ``seq_mean_token_mean``); other aggregation modes weight ``l_i`` by ``n_i``
    (see `aggregate_loss`).

    Args:
        logprobs, old_logprobs, loss_mask, is_weights, entropy: see the module docstring.
        advantages: ``[B]`` float, one advantage per sequence (e.g. GRPO-normalised reward).
        clip_low: lower clip range, ``s_i`` is clipped at ``1 - clip_low``.
        clip_high: upper clip range, ``s_i`` is clipped at ``1 + clip_high``.
        loss_agg_mode: see `aggregate_loss`.
        normalizer: global denominators, see `aggregate_loss`.

    Returns:
        ``(loss, metrics)``: 0-dim loss; clip fractions and ratio statistics are over sequences
        with at least one loss token.

    Raises:
        ValueError: on wrong shapes, clip ranges or ``loss_agg_mode``.
    """
    _check_token_inputs(logprobs, old_logprobs, loss_mask)
    _check_clip(clip_low, clip_high)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"gspo_loss advantages must be [B] {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    keep = loss_mask != 0
    seq_importance_ratio = torch.exp(seq_log_importance_ratio(logprobs, old_logprobs, loss_mask))
    seq_losses, low, high = _clipped_surrogate(seq_importance_ratio, advantages, clip_low, clip_high)
    token_losses = _apply_is_weights(seq_losses[:, None].expand_as(logprobs), is_weights)
    loss = aggregate_loss(token_losses, loss_mask, loss_agg_mode, normalizer)
    has_tokens = keep.any(dim=-1)
    metrics = _common_metrics(loss, _masked_log_ratio(logprobs, old_logprobs, keep), keep, entropy)
    metrics |= _clip_metrics(low, high, has_tokens)
    metrics |= _ratio_metrics("seq_importance_ratio", seq_importance_ratio.detach(), has_tokens)
    return loss, metrics


@register_policy_loss("gspo_token", hyperparameters=CLIPS, ratio_level="sequence", check=_gspo_clip_issues)
def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg_mode: str = "seq_mean_token_mean",
    normalizer: LossNormalizer | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, eq. 13-14): per-token advantages.

    ``s_it = sg[s_i] * exp(logp_it - sg[logp_it])`` equals ``s_i`` in value, with gradient
    ``s_i grad logp_it``; ``l_it = -min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it)``,
    aggregated per token (default ``seq_mean_token_mean``: the paper's
    ``(1/G) sum_i (1/|y_i|) sum_t``). When ``A_it = A_i`` for every token, value and gradient
    equal `gspo_loss`'s in every aggregation mode. With per-token advantages the gradient is,
    by the paper's design, not the derivative of the loss value (stop-gradients); the value always
    equals the clipped ``s_i A_it`` terms. Deviation: optional ``is_weights``.

    Args:
        logprobs, old_logprobs, loss_mask, is_weights, entropy: see the module docstring.
        advantages: ``[B, T]`` per-token advantages (``[B]`` is broadcast over tokens).
        clip_low, clip_high, loss_agg_mode, normalizer: as in `gspo_loss`.

    Returns:
        ``(loss, metrics)``: clip fractions over loss tokens, ratio statistics over sequences.

    Raises:
        ValueError: on wrong shapes, clip ranges or ``loss_agg_mode``.
    """
    _check_token_inputs(logprobs, old_logprobs, loss_mask)
    _check_clip(clip_low, clip_high)
    token_advantages = _token_advantages(advantages, logprobs)
    keep = loss_mask != 0
    seq_importance_ratio = torch.exp(seq_log_importance_ratio(logprobs, old_logprobs, loss_mask)).detach()
    safe_logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    token_ratio = seq_importance_ratio[:, None] * torch.exp(safe_logprobs - safe_logprobs.detach())
    token_losses, low, high = _clipped_surrogate(token_ratio, token_advantages, clip_low, clip_high)
    loss = aggregate_loss(_apply_is_weights(token_losses, is_weights), loss_mask, loss_agg_mode, normalizer)
    metrics = _common_metrics(loss, _masked_log_ratio(logprobs, old_logprobs, keep), keep, entropy)
    metrics |= _clip_metrics(low, high, keep)
    metrics |= _ratio_metrics("seq_importance_ratio", seq_importance_ratio, keep.any(dim=-1))
    return loss, metrics


@register_policy_loss("ppo_clip", hyperparameters={**CLIPS, "clip_c": "clip_c"})
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    loss_agg_mode: str = "token_mean",
    normalizer: LossNormalizer | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """Token-level PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), as used by GRPO.

    ``r_it = exp(logp_it - old_logp_it)``, ``l_it = max(-A_it r_it, -A_it clip(r_it, 1 - clip_low,
    1 + clip_high))``. Separate ``clip_low`` / ``clip_high`` is DAPO's clip-higher (Yu et al. 2025,
    arXiv:2503.14476; e.g. 0.2 / 0.28). With ``clip_c`` (dual clip, Ye et al. 2020,
    arXiv:1912.09729) tokens with ``A_it < 0`` use ``min(l_it, -clip_c A_it)``, bounding the loss
    when ``r_it`` is large. Default aggregation ``token_mean`` (DAPO). Deviation: ``is_weights``.

    Args:
        logprobs, old_logprobs, loss_mask, is_weights, entropy: see the module docstring.
        advantages: ``[B, T]`` per-token advantages (``[B]`` is broadcast over tokens).
        clip_low: ratio clipped below at ``1 - clip_low``.
        clip_high: ratio clipped above at ``1 + clip_high``.
        clip_c: dual-clip constant (> 1), or None for no dual clip.
        loss_agg_mode: see `aggregate_loss`.
        normalizer: global denominators, see `aggregate_loss`.

    Returns:
        ``(loss, metrics)``: clip fractions and ratio statistics over loss tokens.

    Raises:
        ValueError: on wrong shapes, clip ranges, ``clip_c <= 1`` or unknown ``loss_agg_mode``.
    """
    _check_token_inputs(logprobs, old_logprobs, loss_mask)
    _check_clip(clip_low, clip_high)
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (dual clip), got {clip_c}")
    token_advantages = _token_advantages(advantages, logprobs)
    keep = loss_mask != 0
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, keep)
    importance_ratio = torch.exp(log_ratio)
    token_losses, low, high = _clipped_surrogate(importance_ratio, token_advantages, clip_low, clip_high)
    dual_clipped = None
    if clip_c is not None:
        dual_bound = -clip_c * token_advantages
        dual_clipped = (token_advantages < 0) & (token_losses > dual_bound)
        token_losses = torch.where(token_advantages < 0, torch.minimum(token_losses, dual_bound), token_losses)
    loss = aggregate_loss(_apply_is_weights(token_losses, is_weights), loss_mask, loss_agg_mode, normalizer)
    metrics = _common_metrics(loss, log_ratio, keep, entropy)
    metrics |= _clip_metrics(low, high, keep)
    metrics |= _ratio_metrics("importance_ratio", importance_ratio.detach(), keep)
    if dual_clipped is not None:
        metrics["loss/dual_clip_frac"] = mean_metric(dual_clipped.to(logprobs.dtype), keep)
    return loss, metrics


def entropy_bonus_loss(
    entropy: Tensor,
    loss_mask: Tensor,
    *,
    entropy_coef: float,
    loss_agg_mode: str = "token_mean",
    normalizer: LossNormalizer | None = None,
) -> PolicyLossOutput:
    """Entropy bonus as a loss term to add: ``-entropy_coef * aggregate(entropy)``.

    Args:
        entropy: ``[B, T]`` float, per-token entropy of the current policy (with grad), computed
            by the caller from the (vocab-parallel) logits.
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.
        entropy_coef: bonus coefficient (>= 0 raises entropy).
        loss_agg_mode, normalizer: as the policy loss, so the sum stays split-invariant.

    Returns:
        ``(loss, metrics)`` with ``loss/entropy_bonus`` (sum) and ``loss/entropy`` (mean).

    Raises:
        ValueError: on mismatched shapes or an unknown ``loss_agg_mode``.
    """
    loss = -entropy_coef * aggregate_loss(entropy, loss_mask, loss_agg_mode, normalizer)
    metrics = {"loss/entropy_bonus": sum_metric(loss), "loss/entropy": mean_metric(entropy, loss_mask != 0)}
    return loss, metrics


def compute_policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    **kwargs: object,
) -> PolicyLossOutput:
    """Dispatch to the policy loss named by ``algorithm.policy_loss``: a name registered in
    `megarl.algorithms.extensions.POLICY_LOSSES` or an import path ``module:attr``.

    Args:
        name: ``"gspo"``, ``"gspo_token"``, ``"ppo_clip"``, another registered name or an import path.
        logprobs, old_logprobs, advantages, loss_mask: as the selected loss documents.
        **kwargs: keyword arguments of the selected loss (``clip_low``, ``clip_high``,
            ``loss_agg_mode``, ``normalizer``, ``is_weights``, ``entropy``, ``clip_c`` for PPO).

    Returns:
        The selected loss's ``(loss, metrics)``.

    Raises:
        megarl.plugins.PluginError: (a ValueError naming ``algorithm.policy_loss``) an unknown name or
            an import path that does not load.
    """
    return POLICY_LOSSES.resolve(name).fn(logprobs, old_logprobs, advantages, loss_mask, **kwargs)
