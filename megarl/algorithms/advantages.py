"""Group-relative advantage estimators (outcome rewards, one scalar per trajectory).

Each estimator takes ``rewards`` either as ``[num_groups, G]`` (``group_ids=None``; row = the G
trajectories of one prompt) or as ``[N]`` with ``group_ids`` ``[N]`` int (any integers; trajectories
with equal ids form a group; groups may have different sizes). The result has the shape of
``rewards`` and its dtype (integer rewards are converted to the default float dtype). Gradients are
never needed; the functions run under ``torch.no_grad``.

Compute advantages on the whole global batch (all groups) before it is split into micro batches
and data-parallel ranks: ``reinforce_pp`` normalises over the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megarl.algorithms.extensions import ADVANTAGE_ESTIMATORS, register_advantage_estimator

GRPO_EPS = 1e-6
"""Added to the group std in GRPO (as verl; TRL uses 1e-4). A group whose rewards are all equal
gets advantage 0 for every trajectory."""
EPS = {"eps": "advantage_eps"}
"""``eps`` from ``algorithm.advantage_eps``."""


def _as_flat_groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Return ``(flat_rewards [N] float, group_index [N] int64 in [0, num_groups), num_groups)``."""
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [num_groups, G] when group_ids is None, got {tuple(rewards.shape)}")
        num_groups, group_size = rewards.shape
        index = torch.arange(num_groups, device=rewards.device).repeat_interleave(group_size)
        return rewards.reshape(-1), index, num_groups
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards [N] and group_ids [N] must match, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    return rewards, index, num_groups


def _group_stats(rewards: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-trajectory group size, group mean and unbiased group std (0 for groups of size 1)."""
    zeros = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    size = zeros.index_add(0, index, torch.ones_like(rewards))
    mean = zeros.index_add(0, index, rewards) / size.clamp(min=1)
    centered = rewards - mean[index]
    sq = zeros.index_add(0, index, centered * centered)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    return size[index], mean[index], std[index]


@register_advantage_estimator("grpo", hyperparameters=EPS, min_group_size=2)
@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = GRPO_EPS) -> Tensor:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)``.

    ``std_g`` is the unbiased (Bessel-corrected, ``1/(G-1)``) standard deviation over the group,
    as ``torch.std``, verl and TRL use; a group of one trajectory gets advantage 0.

    Args:
        rewards: ``[num_groups, G]`` or ``[N]`` float (see the module docstring).
        group_ids: None or ``[N]`` int.
        eps: added to the std (default `GRPO_EPS`).

    Returns:
        Advantages, the shape of ``rewards``.

    Raises:
        ValueError: on mismatched shapes or float ``group_ids``.
    """
    flat, index, num_groups = _as_flat_groups(rewards, group_ids)
    _, mean, std = _group_stats(flat, index, num_groups)
    return ((flat - mean) / (std + eps)).reshape(rewards.shape)


@register_advantage_estimator("dr_grpo", min_group_size=2)
@torch.no_grad()
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): ``A_i = r_i - mean_g(r)`` (no std division).

    Pair with ``loss_agg_mode="seq_mean_token_sum_norm"`` for the paper's full recipe.

    Args, Returns, Raises: as `grpo_advantages`.
    """
    flat, index, num_groups = _as_flat_groups(rewards, group_ids)
    _, mean, _ = _group_stats(flat, index, num_groups)
    return (flat - mean).reshape(rewards.shape)


@register_advantage_estimator("rloo", min_group_size=2)
@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): ``A_i = r_i - (1/(G-1)) sum_{j != i} r_j``.

    Equals ``G/(G-1) (r_i - mean_g(r))``. A group of one trajectory gets advantage 0 (no baseline
    exists).

    Args, Returns, Raises: as `grpo_advantages`.
    """
    flat, index, num_groups = _as_flat_groups(rewards, group_ids)
    size, mean, _ = _group_stats(flat, index, num_groups)
    scale = size / (size - 1).clamp(min=1)
    advantages = torch.where(size > 1, scale * (flat - mean), torch.zeros_like(flat))
    return advantages.reshape(rewards.shape)


@register_advantage_estimator("reinforce_pp", hyperparameters=EPS)
@torch.no_grad()
def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = GRPO_EPS) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group-mean baseline, batch normalisation.

    ``a_i = r_i - mean_g(r)``, then ``A_i = (a_i - mean_batch(a)) / (std_batch(a) + eps)`` over every
    trajectory of the batch (unbiased std). Deviations: outcome rewards only, normalised per
    trajectory, not per token; the paper's per-token KL reward term is not included (add a KL loss
    with `megarl.algorithms.kl.kl_penalty_loss` instead).

    Args, Returns, Raises: as `grpo_advantages`.
    """
    flat, index, num_groups = _as_flat_groups(rewards, group_ids)
    _, mean, _ = _group_stats(flat, index, num_groups)
    centered = flat - mean
    if centered.numel() < 2:
        return torch.zeros_like(flat).reshape(rewards.shape)
    normalised = (centered - centered.mean()) / (centered.std() + eps)
    return normalised.reshape(rewards.shape)


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor | None = None, **kwargs: object) -> Tensor:
    """Dispatch to the estimator named by ``algorithm.advantage_estimator``: a name registered in
    `megarl.algorithms.extensions.ADVANTAGE_ESTIMATORS` or an import path ``module:attr``.

    Args:
        name: ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"reinforce_pp"``, another registered name or an
            import path.
        rewards: ``[num_groups, G]`` or ``[N]`` float.
        group_ids: None or ``[N]`` int.
        **kwargs: estimator keywords (``eps`` for ``grpo`` and ``reinforce_pp``).

    Returns:
        Advantages, the shape of ``rewards``.

    Raises:
        ValueError: on bad shapes; `megarl.plugins.PluginError` (a ValueError naming
            ``algorithm.advantage_estimator``) for an unknown name or an import path that does not load.
    """
    return ADVANTAGE_ESTIMATORS.resolve(name).fn(rewards, group_ids, **kwargs)


def estimate_advantages(algorithm: Any, rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """The advantages of the estimator ``algorithm.advantage_estimator`` names, called with the
    hyperparameters its entry declares, read from ``algorithm`` (``eps`` <- ``advantage_eps`` for
    ``grpo`` and ``reinforce_pp``; none for ``dr_grpo``, ``rloo`` or a bare function by import path).

    Args:
        algorithm: the ``algorithm`` config section (or any object with its attributes).
        rewards: ``[num_groups, G]`` or ``[N]`` float.
        group_ids: None or ``[N]`` int.

    Returns:
        Advantages, the shape of ``rewards``.

    Raises:
        ValueError: as `compute_advantages`.
    """
    estimator = ADVANTAGE_ESTIMATORS.resolve(algorithm.advantage_estimator)
    return estimator.fn(rewards, group_ids, **estimator.keywords(algorithm))
