"""The ``algorithm`` section of megarl's configuration schema: the RL objective. Re-exported by
:mod:`megarl.config.schema` (the module docstring there describes the schema as a whole)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AlgorithmConfig:
    """The RL objective. ``policy_loss``, ``advantage_estimator`` and ``rollout_correction`` name
    entries of the registries in :mod:`megarl.algorithms.extensions` (built-in, registered by a
    ``plugins:`` module, or an import path ``module:attr``); each entry declares which of the fields
    below it takes."""

    policy_loss: str = "gspo"
    """``gspo`` (sequence-level, default), ``gspo_token`` or ``ppo_clip`` (GRPO/DAPO token level),
    another registered loss, or an import path (``my_pkg.losses:my_loss``; slime's
    ``--custom-loss-function-path``)."""
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the policy loss beyond the fields its entry declares: a plugin loss's
    own hyperparameters (``megarl validate`` checks they bind to its signature)."""
    advantage_estimator: str = "grpo"
    """``grpo`` (group mean/std), ``dr_grpo`` (no std division), ``rloo``, ``reinforce_pp``, another
    registered estimator, or an import path."""
    clip_low: float = 3.0e-4
    """Lower clip range: ratios below ``1 - clip_low`` are clipped. GSPO paper: 3e-4 (PPO/GRPO: 0.2)."""
    clip_high: float = 4.0e-4
    """Upper clip range: ratios above ``1 + clip_high`` are clipped. GSPO paper: 4e-4 (DAPO: 0.28)."""
    clip_c: float | None = None
    """Dual-clip constant for negative advantages (``ppo_clip`` only); None = off."""
    loss_aggregation: str = "seq_mean_token_mean"
    """``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum`` or ``seq_mean_token_sum_norm``."""
    advantage_eps: float = 1.0e-6
    """Added to the group standard deviation before dividing (``grpo``)."""
    kl_coef: float = 0.0
    """Coefficient of the KL(policy || reference) penalty in the loss; 0 = no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: ``k1``, ``k2`` or ``k3``."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    rollout_correction: str = "none"
    """Train-inference mismatch correction: ``none``, ``tis``, ``mis``, ``icepop`` or ``decoupled``
    (AReaL's decoupled PPO for stale rollouts: behaviour = engine, proximal = trainer's old logprobs;
    ``rollout_correction_clip`` is its weight cap), another registered correction, or an import path."""
    rollout_correction_level: str = "token"
    """``token`` or ``sequence`` level importance weights for the correction."""
    rollout_correction_clip: float = 2.0
    """Upper clip of the truncated importance weight (TIS) / upper band (MIS, IcePop) / cap above
    which a token is dropped (decoupled)."""
    rollout_correction_low: float = 0.5
    """Lower band of masked IS / IcePop."""
    max_behaviour_drift: float | None = None
    """Staleness by measured drift: a trajectory whose drift between the engine that sampled it
    (``rollout_logprobs``) and the trainer at this step's weights (``old_logprobs``), measured by
    ``behaviour_drift_statistic`` over its loss tokens, exceeds this (> 0, nats per token) is dropped
    from the loss (``megarl.algorithms.drift``; verl's ``rollout_rs_threshold``); null = off.
    ``rollout.max_staleness`` stays the outer limit."""
    behaviour_drift_statistic: str = "k3_mean"
    """Drift of ``max_behaviour_drift``: ``k3_mean`` (mean k3 estimate of KL(behaviour || old) per
    token), ``log_ratio_abs_mean`` (mean |log ratio|) or ``log_ratio_abs_max`` (worst token)."""
    filter_zero_variance_groups: bool = True
    """Drop groups whose rewards are all equal (they carry no group-relative signal)."""
