"""Pure tensor RL math: policy losses, advantages, KL, rollout corrections, drift filter, loss aggregation.

Policy losses, advantage estimators and rollout corrections are extension points: registries in
`megarl.algorithms.extensions`, which the config's choices are read from and which take import paths.

Only torch is imported here: no config objects and no process groups. See
`megarl.algorithms.aggregation` for how a trainer must split a batch into micro batches and
data-parallel ranks, and `megarl.algorithms.metrics` for how metrics are reduced.
"""

from megarl.algorithms.advantages import compute_advantages
from megarl.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from megarl.algorithms.corrections import (
    RolloutCorrection,
    decoupled_ppo,
    icepop,
    masked_is,
    truncated_is,
)
from megarl.algorithms.drift import DRIFT_STATISTICS, DriftFilter, behaviour_drift, drift_filter
from megarl.algorithms.extensions import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdvantageEstimator,
    PolicyLoss,
    RolloutCorrectionMethod,
    register_advantage_estimator,
    register_policy_loss,
    register_rollout_correction,
)
from megarl.algorithms.kl import KL_ESTIMATORS, kl_estimate, kl_penalty_loss
from megarl.algorithms.losses import (
    compute_policy_loss,
    entropy_bonus_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
)
from megarl.algorithms.metrics import Metric, reduce_metrics

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DRIFT_STATISTICS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdvantageEstimator",
    "DriftFilter",
    "LossNormalizer",
    "Metric",
    "PolicyLoss",
    "RolloutCorrection",
    "RolloutCorrectionMethod",
    "aggregate_loss",
    "behaviour_drift",
    "compute_advantages",
    "compute_policy_loss",
    "decoupled_ppo",
    "drift_filter",
    "entropy_bonus_loss",
    "gspo_loss",
    "gspo_token_loss",
    "icepop",
    "kl_estimate",
    "kl_penalty_loss",
    "masked_is",
    "ppo_clip_loss",
    "reduce_metrics",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_rollout_correction",
    "truncated_is",
]
