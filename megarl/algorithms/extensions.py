"""The algorithm's extension points: policy losses, advantage estimators, rollout corrections.

Each is a :class:`megarl.registry.Registry` keyed by its ``algorithm`` config field. An entry wraps
the function and declares what validation and the trainer need to know:

- ``hyperparameters``: keyword argument -> the ``algorithm`` field it is read from (``{"clip_c":
  "clip_c"}``, ``{"upper": "rollout_correction_clip"}``). The caller passes
  :meth:`Extension.keywords` of the config section, so no caller branches on the entry's name.
- a policy loss: whether its importance ratio is per ``token`` or per ``sequence``
  (``ratio_level``: a sequence ratio with GSPO's tight clip cannot absorb FP8 delayed-scaling noise)
  and an optional ``check`` of its hyperparameter values; it also takes every key of
  ``algorithm.policy_loss_kwargs`` (a plugin loss's own settings, which have no field).
- an advantage estimator: the smallest group it gives a signal for (``min_group_size``).

The built-in entries register themselves where they are defined (``@register_policy_loss("gspo",
...)`` in `megarl.algorithms.losses`); a plugin registers with the same decorators (a module under
``plugins:``) or is named by import path (``algorithm.policy_loss: my_pkg.losses:my_loss``); a bare
function given by import path becomes an entry with no declared hyperparameters (its settings come
from ``algorithm.policy_loss_kwargs``), an entry object given by import path is used as it is.

Call protocols (the built-ins' docstrings give shapes and formulas):

- policy loss: ``fn(logprobs [B, T], old_logprobs [B, T], advantages [B], loss_mask [B, T], *,
  loss_agg_mode, normalizer, is_weights, entropy, **hyperparameters) -> (loss 0-dim, metrics)``;
- advantage estimator: ``fn(rewards, group_ids, **hyperparameters) -> advantages`` (shape of ``rewards``);
- rollout correction: ``fn(old_logprobs [B, T], rollout_logprobs [B, T], loss_mask [B, T],
  **hyperparameters) -> RolloutCorrection``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Self

from megarl.registry import Registry

Check = Callable[[Mapping[str, Any]], list[tuple[str, str]]]
"""``check(keywords) -> [(keyword, problem), ...]`` over a policy loss's hyperparameter values."""


@dataclasses.dataclass(frozen=True)
class Extension:
    """An entry of an algorithm registry.

    Attributes:
        fn: the function (its call protocol is the registry's, module docstring).
        hyperparameters: keyword argument of ``fn`` -> the ``algorithm`` config field holding it.
    """

    fn: Callable[..., Any]
    hyperparameters: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, obj: Any) -> Self:
        """``obj`` if it is an entry of this type, else a callable wrapped as one (no hyperparameters).

        Raises:
            TypeError: ``obj`` is neither an entry of this type nor callable.
        """
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Extension) or not callable(obj):
            raise TypeError(f"{obj!r} is neither a function nor a {cls.__name__}")
        return cls(obj)

    def keywords(self, algorithm: Any) -> dict[str, Any]:
        """The keyword arguments of :attr:`fn` read from ``algorithm`` (the ``algorithm`` config
        section, or any object with those attributes)."""
        return {keyword: getattr(algorithm, field) for keyword, field in self.hyperparameters.items()}


@dataclasses.dataclass(frozen=True)
class PolicyLoss(Extension):
    """A policy loss entry (``algorithm.policy_loss``).

    Attributes:
        ratio_level: ``token`` (one importance ratio per token) or ``sequence`` (one per sequence,
            GSPO): a sequence ratio with a tight clip needs FP8 recipes without scaling history
            (`megarl.training.fp8.fp8_recipe_issues`).
        check: problems of the hyperparameter values beyond each field's own domain, or None.
    """

    ratio_level: Literal["token", "sequence"] = "token"
    check: Check | None = None

    def keywords(self, algorithm: Any) -> dict[str, Any]:
        """The declared hyperparameters, then ``algorithm.policy_loss_kwargs`` (when the section has it)."""
        return {**super().keywords(algorithm), **dict(getattr(algorithm, "policy_loss_kwargs", None) or {})}


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator(Extension):
    """An advantage estimator entry (``algorithm.advantage_estimator``).

    Attributes:
        min_group_size: the fewest trajectories per prompt that give a nonzero advantage
            (``rollout.group_size`` is checked against it; 1 = no group needed).
    """

    min_group_size: int = 1


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionMethod(Extension):
    """A train-inference mismatch correction entry (``algorithm.rollout_correction``; ``none`` is off)."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "algorithm.policy_loss", entry_of=PolicyLoss.of)
"""``algorithm.policy_loss`` -> :class:`PolicyLoss` (built-ins: `megarl.algorithms.losses`)."""
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "algorithm.advantage_estimator", entry_of=AdvantageEstimator.of)
"""``algorithm.advantage_estimator`` -> :class:`AdvantageEstimator` (built-ins: `megarl.algorithms.advantages`)."""
ROLLOUT_CORRECTIONS: Registry[RolloutCorrectionMethod] = Registry(
    "rollout correction", "algorithm.rollout_correction", entry_of=RolloutCorrectionMethod.of)
"""``algorithm.rollout_correction`` -> :class:`RolloutCorrectionMethod` (built-ins: `megarl.algorithms.corrections`)."""


def _registrar(registry: Registry, entry: Callable[..., Extension], name: str,
               declared: dict[str, Any]) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        registry.add(name, entry(fn, **declared))
        return fn
    return decorator


def register_policy_loss(name: str, *, hyperparameters: Mapping[str, str] | None = None,
                         ratio_level: Literal["token", "sequence"] = "token",
                         check: Check | None = None) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss function as ``name`` (:class:`PolicyLoss`'s fields).

    Raises:
        ValueError: ``name`` is already registered to another loss.
    """
    declared = dict(hyperparameters=dict(hyperparameters or {}), ratio_level=ratio_level, check=check)
    return _registrar(POLICY_LOSSES, PolicyLoss, name, declared)


def register_advantage_estimator(name: str, *, hyperparameters: Mapping[str, str] | None = None,
                                 min_group_size: int = 1) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator as ``name`` (:class:`AdvantageEstimator`'s fields).

    Raises:
        ValueError: ``name`` is already registered to another estimator.
    """
    declared = dict(hyperparameters=dict(hyperparameters or {}), min_group_size=min_group_size)
    return _registrar(ADVANTAGE_ESTIMATORS, AdvantageEstimator, name, declared)


def register_rollout_correction(name: str, *, hyperparameters: Mapping[str, str] | None = None
                                ) -> Callable[[Callable], Callable]:
    """Decorator registering a rollout correction as ``name`` (:class:`RolloutCorrectionMethod`'s fields).

    Raises:
        ValueError: ``name`` is already registered to another correction.
    """
    return _registrar(ROLLOUT_CORRECTIONS, RolloutCorrectionMethod, name,
                      dict(hyperparameters=dict(hyperparameters or {})))
