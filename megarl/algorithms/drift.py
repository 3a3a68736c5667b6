"""Staleness by measured drift: drop trajectories whose behaviour policy is too far from ``pi_old``.

In asynchronous RL a trajectory is sampled by ``pi_behav`` (the engine, possibly several policy
versions old; its logprobs are ``rollout_logprobs``) and trained around ``pi_old`` (the trainer at
the weights of this step, recomputed before the first update: ``old_logprobs``).
``rollout.max_staleness`` bounds the number of versions between the two, a proxy; this module
bounds what the proxy stands for, the measured distance between the two policies on the
trajectory's own tokens. Per trajectory ``i`` with loss tokens ``t in M_i`` and
``d_it = log pi_old(y_it) - log pi_behav(y_it)``:

- ``"k3_mean"`` (default): ``D_i = (1/|M_i|) sum_t (exp(d_it) - 1 - d_it)``, the k3 estimate
  (Schulman 2020) of ``KL(pi_behav || pi_old)`` per token. The tokens were sampled from
  ``pi_behav``, which is exactly the distribution k3 needs to be unbiased; each term is >= 0
  (no cancellation between tokens, unlike k1); the mean makes it independent of length (a long
  trajectory is not dropped for being long, unlike a sum); and a KL is what the trust-region
  argument behind PPO and decoupled PPO bounds. It is verl's ``rollout_rs="seq_mean_k3"``.
- ``"log_ratio_abs_mean"``: ``D_i = (1/|M_i|) sum_t |d_it|`` (megarl's ``mismatch/log_ratio_abs_mean``
  per trajectory; symmetric, first order in ``d``, so its thresholds read as "nats per token").
- ``"log_ratio_abs_max"``: ``D_i = max_t |d_it|``: the worst token decides (strictest; one
  outlier token drops the trajectory).

A trajectory with ``D_i > max_drift`` (strictly) is **dropped**: its whole loss mask is zeroed
before the loss denominators are counted, so it adds neither to the numerator nor to the token /
sequence counts of the loss (slime #657's lesson for rejection sampling). The rule follows
sequence-level rejection sampling of the masked-IS family (Liu et al. 2025, "When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; verl's ``rollout_rs``)
with the proximal/behaviour split of decoupled PPO (Fu et al. 2025, AReaL, arXiv:2505.24298).
Deviations:

1. The drift is measured against ``pi_old`` (trainer, current weights), not against the trainer at
   the sampling-time weights: it is the staleness drift *plus* the train-inference mismatch, the
   same ``pi_prox / pi_behav`` that decoupled PPO's behaviour weight corrects. With no staleness it
   measures the mismatch alone, so ``max_drift`` must sit above the run's mismatch floor
   (``mismatch/kl_k3`` at staleness 0).
2. Drop only, no down-weighting: no paper defines a drift-proportional weight, and down-weighting
   by the importance weight is what the truncated-IS family already does
   (``algorithm.rollout_correction=tis``), which composes with this filter (it runs on the
   trajectories the filter keeps).
3. Not M2PO (Zheng et al. 2025, arXiv:2510.01161): M2PO masks tokens until the *batch's* second
   moment of ``log(pi_theta / pi_behav)`` is under a threshold, so a token's fate depends on its
   batch-mates (and in megarl on how the step is sharded over data-parallel ranks). Here the
   decision is a pure function of one trajectory's own logprobs (below).
4. Group-relative advantages are computed before the filter (on the driver, which never sees
   per-token data); a dropped trajectory leaves its group's other advantages unchanged, as in
   verl's rejection sampling.

Resume safety: ``D_i`` reads only trajectory ``i``'s own ``old_logprobs``, ``rollout_logprobs`` and
loss mask (each row reduced alone, so not even the padding width of the batch or the order of
its rows changes a bit of it) and no state is carried from step to step. After a restart the
trainer's weights, hence ``old_logprobs``, are those of the checkpoint, so the same trajectory gets
the same drift and the same decision as without the restart. ``rollout.max_staleness`` stays the
outer limit (trajectories older than it are dropped on the driver before they reach a trainer).

Metrics (``section/name``): ``filter/dropped_drift_frac`` (mean over trajectories with at least one
loss token), ``filter/dropped_drift_token_frac`` (mean over loss tokens),
``mismatch/behaviour_drift_mean`` (mean of ``D_i`` over trajectories with loss tokens) and
``mismatch/behaviour_drift_max`` (their max).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from megarl.algorithms.corrections import check_padded
from megarl.algorithms.metrics import Metric, extreme_metric, mean_metric

DRIFT_STATISTICS: tuple[str, ...] = ("k3_mean", "log_ratio_abs_mean", "log_ratio_abs_max")


@dataclasses.dataclass(frozen=True, slots=True)
class DriftFilter:
    """Result of `drift_filter`.

    Attributes:
        loss_mask: ``[B, T]`` bool, the input mask with every dropped trajectory's row zeroed.
        drift: ``[B]`` float64, ``D_i`` (module docstring); 0 for a trajectory without loss tokens.
        dropped: ``[B]`` bool, True = the trajectory's drift exceeds the bound.
        metrics: ``dict[str, Metric]`` (module docstring).
    """

    loss_mask: Tensor
    drift: Tensor
    dropped: Tensor
    metrics: dict[str, Metric]


def _check(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, statistic: str) -> Tensor:
    if statistic not in DRIFT_STATISTICS:
        raise ValueError(f"behaviour drift statistic must be one of {DRIFT_STATISTICS}, got {statistic!r}")
    return check_padded(old_logprobs, rollout_logprobs, loss_mask)


@torch.no_grad()
def behaviour_drift(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *,
                    statistic: str = "k3_mean") -> Tensor:
    """Per-trajectory drift ``D_i`` between ``pi_old`` and ``pi_behav`` over its loss tokens.

    Each row is reduced on its own gathered loss tokens (a loop over ``B``, not a masked reduction
    of the padded batch): a masked ``sum(dim=-1)`` may group its additions differently for another
    padding width, so a trajectory's bits would depend on its batch-mates. Computed in float64.

    Args:
        old_logprobs: ``[B, T]`` float, trainer logprobs at this step's weights (proximal policy).
        rollout_logprobs: ``[B, T]`` float, engine logprobs of the same tokens (behaviour policy).
        loss_mask: ``[B, T]`` bool or {0, 1}; 1 = trained token; other positions are ignored
            (they may hold any value).
        statistic: ``"k3_mean"``, ``"log_ratio_abs_mean"`` or ``"log_ratio_abs_max"`` (module
            docstring); units: nats per token.

    Returns:
        ``[B]`` float64 ``D_i >= 0``; 0 for a row without loss tokens.

    Raises:
        ValueError: an unknown statistic or mismatched shapes.
    """
    keep = _check(old_logprobs, rollout_logprobs, loss_mask, statistic)
    drift = torch.zeros(keep.shape[0], dtype=torch.float64, device=keep.device)
    for i in range(keep.shape[0]):
        log_ratio = old_logprobs[i][keep[i]].double() - rollout_logprobs[i][keep[i]].double()
        if log_ratio.numel() == 0:
            continue
        if statistic == "k3_mean":
            drift[i] = (torch.expm1(log_ratio) - log_ratio).mean()
        elif statistic == "log_ratio_abs_mean":
            drift[i] = log_ratio.abs().mean()
        else:
            drift[i] = log_ratio.abs().max()
    return drift


@torch.no_grad()
def drift_filter(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *, max_drift: float,
                 statistic: str = "k3_mean") -> DriftFilter:
    """Drop the trajectories whose measured behaviour drift exceeds ``max_drift`` (module docstring).

    Args:
        old_logprobs, rollout_logprobs, loss_mask, statistic: as `behaviour_drift`.
        max_drift: the bound (``algorithm.max_behaviour_drift``), > 0, in the statistic's units;
            a trajectory with ``D_i > max_drift`` is dropped, one at exactly the bound is kept.

    Returns:
        `DriftFilter`; metrics are over this batch (reduce over micro batches / ranks with
        `megarl.algorithms.metrics`).

    Raises:
        ValueError: ``max_drift <= 0`` (or not a number), an unknown statistic or mismatched shapes.
    """
    if not isinstance(max_drift, (int, float)) or isinstance(max_drift, bool) or not max_drift > 0:
        raise ValueError(f"algorithm.max_behaviour_drift must be > 0 (or null: off), got {max_drift!r}")
    drift = behaviour_drift(old_logprobs, rollout_logprobs, loss_mask, statistic=statistic)
    keep = loss_mask != 0
    has_tokens = keep.any(dim=-1)
    dropped = (drift > max_drift) & has_tokens
    new_mask = keep & ~dropped[:, None]
    metrics = {
        "filter/dropped_drift_frac": mean_metric(dropped.double(), has_tokens),
        "filter/dropped_drift_token_frac": mean_metric(dropped[:, None].expand_as(keep).double(), keep),
        "mismatch/behaviour_drift_mean": mean_metric(drift, has_tokens),
        "mismatch/behaviour_drift_max": extreme_metric(drift, has_tokens, "max"),
    }
    return DriftFilter(loss_mask=new_mask, drift=drift, dropped=dropped, metrics=metrics)
