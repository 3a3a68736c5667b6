"""Rollout (train-inference mismatch) corrections: TIS, masked IS (MIS), IcePop, decoupled PPO.

The engine samples from ``pi_rollout`` (its logprobs: ``rollout_logprobs``) while the loss
assumes ``pi_old`` (the trainer at the same weights: ``old_logprobs``); kernels, precision and MoE
routing make them differ. Each correction turns the importance weight
``w = pi_old / pi_rollout`` into a detached weight per token and possibly a smaller loss mask:

- level ``"token"``: ``w_it = exp(old_logp_it - rollout_logp_it)``;
- level ``"sequence"``: ``w_i = exp(sum_t m_it (old_logp_it - rollout_logp_it))`` (product of token
  ratios), broadcast to the sequence's tokens;
- level ``"geometric"``: ``w_i = exp(mean_t ...)``, the length-normalised form that matches GSPO.

Pass ``weights`` as ``is_weights`` and ``loss_mask`` as the loss mask of a policy loss
(`megarl.algorithms.losses`), and count the `LossNormalizer` from that returned ``loss_mask``.

Metrics (``section/name``; means are over the input loss tokens unless stated):
``mismatch/log_ratio_abs_mean`` = mean ``|old_logp - rollout_logp|``;
``mismatch/token_prob_ratio_error`` = mean ``exp(|old_logp - rollout_logp|)`` (NeMo-RL's
``token_mult_prob_error``, which users gate CI on, e.g. median over steps < 1.05);
``mismatch/kl_k3`` = k3 estimate of ``KL(pi_rollout || pi_old)``;
``mismatch/is_clip_frac`` (TIS) or ``mismatch/is_masked_frac`` (MIS, IcePop) over tokens or
sequences (per level); ``mismatch/is_weight_{mean,min,max}`` over the kept tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from megarl.algorithms.extensions import register_rollout_correction
from megarl.algorithms.metrics import Metric, extreme_metric, mean_metric

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
UPPER = {"upper": "rollout_correction_clip"}
LOWER = {"lower": "rollout_correction_low"}
LEVEL = {"level": "rollout_correction_level"}
"""Keyword arguments of the corrections -> the ``algorithm`` fields they are read from."""


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutCorrection:
    """Result of a rollout correction.

    Attributes:
        weights: ``[B, T]`` float, detached importance weight of each token (a sequence weight is
            repeated over its tokens); 0 where the returned ``loss_mask`` is False.
        loss_mask: ``[B, T]`` bool, the input mask minus dropped tokens or sequences.
        metrics: ``dict[str, Metric]`` (module docstring).
    """

    weights: Tensor
    loss_mask: Tensor
    metrics: dict[str, Metric]


def _log_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, keep: Tensor, level: str) -> Tensor:
    """Log importance weight per token ``[B, T]`` at the given level (0 outside ``keep``)."""
    if level not in LEVELS:
        raise ValueError(f"correction level must be one of {LEVELS}, got {level!r}")
    zeros = torch.zeros_like(old_logprobs)
    log_ratio = torch.where(keep, old_logprobs, zeros) - torch.where(keep, rollout_logprobs, zeros)
    if level == "token":
        return log_ratio
    seq_log = log_ratio.sum(dim=-1, keepdim=True)
    if level == "geometric":
        seq_log = seq_log / keep.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(keep, seq_log.expand_as(log_ratio), zeros)


def check_padded(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Check ``[B, T]`` trainer / engine logprobs and loss mask of one shape; return the mask as bool.

    Raises:
        ValueError: ``old_logprobs`` is not 2-D, or another input's shape differs from it.
    """
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be [B, T], got shape {tuple(old_logprobs.shape)}")
    for name, tensor in (("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask)):
        if tensor.shape != old_logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != old_logprobs shape {tuple(old_logprobs.shape)}")
    return loss_mask != 0


def _items(flags: Tensor, keep: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """Per-token flags and mask, or per-sequence (first loss token decides) for sequence levels."""
    if level == "token":
        return flags, keep
    return (flags & keep).any(dim=-1), keep.any(dim=-1)


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> dict[str, Metric]:
    """Trainer-vs-engine logprob metrics over loss tokens (module docstring), no correction.

    Args:
        old_logprobs: ``[B, T]`` trainer logprobs at the sampling-time weights.
        rollout_logprobs: ``[B, T]`` engine logprobs of the same tokens.
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.

    Returns:
        ``mismatch/log_ratio_abs_mean``, ``mismatch/token_prob_ratio_error``, ``mismatch/kl_k3``.
    """
    keep = check_padded(old_logprobs, rollout_logprobs, loss_mask)
    log_ratio = _log_weights(old_logprobs.detach(), rollout_logprobs.detach(), keep, "token")
    return {
        "mismatch/log_ratio_abs_mean": mean_metric(log_ratio.abs(), keep),
        "mismatch/token_prob_ratio_error": mean_metric(torch.exp(log_ratio.abs()), keep),
        "mismatch/kl_k3": mean_metric(torch.expm1(log_ratio) - log_ratio, keep),
    }


def _result(
    weights: Tensor, new_keep: Tensor, base: dict[str, Metric], frac_name: str, frac: Metric
) -> RolloutCorrection:
    weights = torch.where(new_keep, weights, torch.zeros_like(weights)).detach()
    metrics = dict(base)
    metrics[frac_name] = frac
    metrics["mismatch/is_weight_mean"] = mean_metric(weights, new_keep)
    metrics["mismatch/is_weight_min"] = extreme_metric(weights, new_keep, "min")
    metrics["mismatch/is_weight_max"] = extreme_metric(weights, new_keep, "max")
    return RolloutCorrection(weights=weights, loss_mask=new_keep, metrics=metrics)


@register_rollout_correction("tis", hyperparameters={**UPPER, **LEVEL})
@torch.no_grad()
def truncated_is(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> RolloutCorrection:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): ``weight = min(w, upper)`` (and ``max(., lower)`` if given).

    Args:
        old_logprobs, rollout_logprobs: ``[B, T]`` float (module docstring).
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        upper: truncation cap (default 2.0).
        lower: optional floor, None for no floor.

    Returns:
        `RolloutCorrection`; ``loss_mask`` is unchanged; ``mismatch/is_clip_frac`` is the fraction of
        tokens (token level) or sequences whose weight was truncated.

    Raises:
        ValueError: on an unknown level, bad bounds or mismatched shapes.
    """
    keep = check_padded(old_logprobs, rollout_logprobs, loss_mask)
    if upper <= 0 or (lower is not None and not 0 <= lower <= upper):
        raise ValueError(f"truncated_is needs 0 <= lower <= upper and upper > 0, got lower={lower} upper={upper}")
    raw = torch.exp(_log_weights(old_logprobs, rollout_logprobs, keep, level))
    weights = raw.clamp(min=lower, max=upper)
    truncated = raw > upper if lower is None else (raw > upper) | (raw < lower)
    flags, items = _items(truncated, keep, level)
    frac = mean_metric(flags.to(raw.dtype), items)
    base = mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask)
    return _result(weights, keep, base, "mismatch/is_clip_frac", frac)


@register_rollout_correction("mis", hyperparameters={**UPPER, **LOWER, **LEVEL})
@torch.no_grad()
def masked_is(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    level: str = "token",
    lower: float = 0.5,
    upper: float = 2.0,
) -> RolloutCorrection:
    """Masked importance sampling (MIS): keep weight ``w`` inside ``[lower, upper]``, drop the rest.

    Tokens (token level) or whole sequences (sequence levels) whose weight leaves the band are
    removed from the loss mask; the others keep their untruncated weight ``w``.

    Args:
        old_logprobs, rollout_logprobs: ``[B, T]`` float (module docstring).
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        lower: band lower bound (default 0.5).
        upper: band upper bound (default 2.0).

    Returns:
        `RolloutCorrection`; ``mismatch/is_masked_frac`` is the fraction of tokens or sequences
        dropped.

    Raises:
        ValueError: on an unknown level, ``not 0 <= lower <= upper`` or mismatched shapes.
    """
    keep = check_padded(old_logprobs, rollout_logprobs, loss_mask)
    if not 0 <= lower <= upper:
        raise ValueError(f"masked_is needs 0 <= lower <= upper, got lower={lower} upper={upper}")
    raw = torch.exp(_log_weights(old_logprobs, rollout_logprobs, keep, level))
    outside = (raw < lower) | (raw > upper)
    flags, items = _items(outside, keep, level)
    frac = mean_metric(flags.to(raw.dtype), items)
    base = mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask)
    return _result(raw, keep & ~outside, base, "mismatch/is_masked_frac", frac)


@register_rollout_correction("icepop", hyperparameters={**UPPER, **LOWER})
@torch.no_grad()
def icepop(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 5.0,
) -> RolloutCorrection:
    """IcePop (Ling Team 2025, Ring-1T, arXiv:2510.18855): token-level discrepancy masking.

    Each token's policy gradient is multiplied by ``M(w) = w if lower <= w <= upper else 0`` with
    ``w = pi_train / pi_infer``; defaults are the paper's ``alpha = 0.5``, ``beta = 5``. This is
    `masked_is` at token level with IcePop's band.

    Args, Returns, Raises: as `masked_is` (no ``level``).
    """
    return masked_is(old_logprobs, rollout_logprobs, loss_mask, level="token", lower=lower, upper=upper)


@register_rollout_correction("decoupled", hyperparameters=UPPER)
@torch.no_grad()
def decoupled_ppo(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    upper: float | None = 2.0,
) -> RolloutCorrection:
    """Behaviour-policy weight of the decoupled PPO objective (AReaL; Fu et al. 2025,
    arXiv:2505.24298, eq. 5), for asynchronous RL where the sampling policy is stale.

    Three policies: ``pi_behav`` sampled the tokens (the engine, possibly several policy versions
    old: ``rollout_logprobs``), ``pi_prox`` is the proximal policy the clip is centred on (the
    trainer's weights before this update: ``old_logprobs``) and ``pi_theta`` is being trained.
    The objective per token is

        ``min((pi_theta / pi_behav) A, clip(pi_theta / pi_prox, 1 - eps, 1 + eps) (pi_prox / pi_behav) A)``
        ``= w * min(r A, clip(r, 1 - eps, 1 + eps) A)``, with ``w = pi_prox / pi_behav`` and
        ``r = pi_theta / pi_prox``,

    i.e. PPO's clipped surrogate around ``pi_prox`` (`megarl.algorithms.losses.ppo_clip_loss` with
    ``old_logprobs`` = proximal) times the detached token weight ``w`` returned here. As in AReaL's
    implementation (``behav_imp_weight_cap``), a token whose ``w`` exceeds ``upper`` is removed from
    the loss mask rather than truncated. Deviations: none for ``ppo_clip``; under ``gspo`` the
    weight multiplies each token's copy of the sequence loss (the paper defines only the token
    form).

    Args:
        old_logprobs: ``[B, T]`` float, proximal policy (trainer, current weights before the update).
        rollout_logprobs: ``[B, T]`` float, behaviour policy (the engine that sampled the tokens).
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.
        upper: cap on ``w`` above which a token is dropped; None keeps every token.

    Returns:
        `RolloutCorrection` with the untruncated ``w`` on kept tokens; ``mismatch/is_masked_frac``
        is the fraction of loss tokens dropped by the cap.

    Raises:
        ValueError: ``upper <= 0`` or mismatched shapes.
    """
    keep = check_padded(old_logprobs, rollout_logprobs, loss_mask)
    if upper is not None and upper <= 0:
        raise ValueError(f"decoupled_ppo needs upper > 0 (or None), got {upper}")
    raw = torch.exp(_log_weights(old_logprobs, rollout_logprobs, keep, "token"))
    dropped = raw > upper if upper is not None else torch.zeros_like(keep)
    frac = mean_metric((dropped & keep).to(raw.dtype), keep)
    base = mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask)
    return _result(raw, keep & ~dropped, base, "mismatch/is_masked_frac", frac)


