"""KL estimators between the policy and a reference policy, and a KL penalty loss term.

For a sampled token ``y ~ pi`` with ``log_r = ref_logp(y) - logp(y)`` (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

- ``k1 = -log_r``: unbiased for ``KL(pi || pi_ref)``, high variance, can be negative.
- ``k2 = log_r^2 / 2``: biased (second order in the log-ratio), low variance, >= 0.
- ``k3 = exp(log_r) - 1 - log_r``: unbiased, low variance, >= 0 (GRPO's penalty).

As loss terms with samples treated as constants, on-policy (``pi_theta`` = sampler):
``E[grad k2] = grad KL(pi_theta || pi_ref)``, ``E[grad k1] = 0`` and
``E[grad k3] = grad KL(pi_ref || pi_theta)`` (the forward KL). The importance-weighted form
(``old_logprobs`` given) uses tokens sampled from ``pi_old`` and multiplies by
``rho = pi_theta / pi_old`` **with** gradient: ``E_old[rho k] = E_theta[k]`` for every ``theta``, so
for k1 and k3 both the value and the gradient are unbiased for ``KL(pi_theta || pi_ref)`` (the
DeepSeek-V3.2 form of k3).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megarl.algorithms.aggregation import LossNormalizer, aggregate_loss
from megarl.algorithms.metrics import Metric, mean_metric, sum_metric

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    *,
    estimator: str = "k3",
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)``.

    Args:
        logprobs: ``[B, T]`` (or any shape) float, current policy logprobs of the sampled tokens.
        ref_logprobs: same shape, reference policy logprobs of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (module docstring).
        old_logprobs: same shape or None. When given, tokens were sampled from ``pi_old`` and the
            estimate is multiplied by ``exp(logprobs - old_logprobs)`` (gradient flows through it).

    Returns:
        Tensor of the input shape; no masking is applied (mask with ``loss_mask`` downstream).

    Raises:
        ValueError: on an unknown estimator or mismatched shapes.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}")
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r * log_r
    else:
        kl = torch.expm1(log_r) - log_r
    if old_logprobs is not None:
        if old_logprobs.shape != logprobs.shape:
            raise ValueError(
                f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
        kl = torch.exp(logprobs - old_logprobs) * kl
    return kl


def _zero_outside(values: Tensor, keep: Tensor) -> Tensor:
    """``values`` on kept tokens, 0 elsewhere (padding may hold inf, which would poison grads)."""
    return torch.where(keep, values, torch.zeros_like(values))


def kl_penalty_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k3",
    old_logprobs: Tensor | None = None,
    loss_agg_mode: str = "token_mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, dict[str, Metric]]:
    """KL penalty term to add to a policy loss: ``kl_coef * aggregate(kl_estimate(...))``.

    Args:
        logprobs, ref_logprobs, estimator, old_logprobs: as `kl_estimate` (``[B, T]``).
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token.
        kl_coef: penalty coefficient (GSPO's paper uses 0, i.e. no penalty).
        loss_agg_mode, normalizer: as `megarl.algorithms.aggregation.aggregate_loss`; use the
            same as the policy loss so their sum stays split-invariant.

    Returns:
        ``(loss, metrics)``: ``loss`` 0-dim; metrics ``loss/kl_penalty`` (sum) and ``kl/ref_{estimator}``
        (mean over loss tokens, the unweighted KL estimate without ``kl_coef``).

    Raises:
        ValueError: on an unknown estimator, loss_agg_mode or mismatched shapes.
    """
    keep = loss_mask != 0
    kl = kl_estimate(
        _zero_outside(logprobs, keep),
        _zero_outside(ref_logprobs, keep),
        estimator=estimator,
        old_logprobs=None if old_logprobs is None else _zero_outside(old_logprobs, keep),
    )
    loss = kl_coef * aggregate_loss(kl, loss_mask, loss_agg_mode, normalizer)
    metrics = {"loss/kl_penalty": sum_metric(loss), f"kl/ref_{estimator}": mean_metric(kl, keep)}
    return loss, metrics
