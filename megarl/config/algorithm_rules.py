"""The ``algorithm`` section against the registries of :mod:`megarl.algorithms.extensions`.

Each of ``policy_loss``, ``advantage_estimator`` and ``rollout_correction`` is resolved (a registered
name, or an import path whose module is imported here, so a misspelled module or attribute is
reported with the field that names it) and checked against its entry, with no rule naming a loss:

- the entry's function takes the registry's call protocol plus the hyperparameters the entry
  declares (and, for a loss, ``algorithm.policy_loss_kwargs``), checked on its signature;
- a policy loss's own ``check`` of its values (GSPO refuses PPO-sized clip ranges);
- an opt-in field (schema default null, e.g. ``clip_c``) that some loss declares but the chosen one
  does not is refused rather than silently ignored;
- ``rollout.group_size`` is at least the estimator's ``min_group_size``.

Unknown plain names are the field domain's to report (:class:`megarl.config.domains.Registered`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from megarl.algorithms.extensions import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS, Extension, PolicyLoss
from megarl.config.domains import DOMAINS
from megarl.config.plugin_check import Issue, binding_problem
from megarl.config.schema_algorithm import AlgorithmConfig
from megarl.plugins import PluginError
from megarl.registry import Registry

E = TypeVar("E", bound=Extension)

_NULL_DEFAULTS = {f.name for f in dataclasses.fields(AlgorithmConfig) if f.default is None}
"""``algorithm`` fields that are off unless set (``clip_c``)."""


def _entry(registry: Registry[E], spec: str, issues: list[Issue]) -> E | None:
    """The entry ``spec`` names, None for an unknown name (the domain's) or a failed import path (an issue)."""
    if not registry.allows(spec):
        return None
    try:
        return registry.resolve(spec)
    except PluginError as e:
        issues.append((registry.key, e.message, spec))
        return None


def _field_of(loss: PolicyLoss, keyword: str) -> str:
    field = loss.hyperparameters.get(keyword)
    return f"algorithm.{field}" if field else f"algorithm.policy_loss_kwargs.{keyword}"


def _loss_issues(loss: PolicyLoss, a: Any) -> list[Issue]:
    """The policy loss's signature, its own check and the opt-in fields it does not take."""
    issues: list[Issue] = []
    extra = dict(a.policy_loss_kwargs or {})
    for keyword in sorted(set(extra) & set(loss.hyperparameters)):
        issues.append((f"algorithm.policy_loss_kwargs.{keyword}", f"policy_loss={a.policy_loss} takes it from "
                       f"algorithm.{loss.hyperparameters[keyword]}; set it there", extra[keyword]))
    keywords = loss.keywords(a)
    problem = binding_problem(loss.fn, None, None, None, None, loss_agg_mode=a.loss_aggregation, normalizer=None,
                              is_weights=None, entropy=None, **keywords)
    if problem:
        issues.append(("algorithm.policy_loss", "a policy loss is called as fn(logprobs, old_logprobs, advantages, "
                       "loss_mask, *, loss_agg_mode, normalizer, is_weights, entropy, **hyperparameters) with its "
                       f"declared hyperparameters and algorithm.policy_loss_kwargs: {problem}", a.policy_loss))
    elif loss.check is not None:
        found = [(_field_of(loss, k), message, keywords[k]) for k, message in loss.check(keywords)]
        issues += [(key, message, value) for key, message, value in found  # outside its domain: reported there
                   if key not in DOMAINS or DOMAINS[key].allows(value)]
    declared_elsewhere = {field: name for name, other in POLICY_LOSSES.items()
                          for field in other.hyperparameters.values()}
    for field in sorted((set(declared_elsewhere) & _NULL_DEFAULTS) - set(loss.hyperparameters.values())):
        value = getattr(a, field)
        if value is not None:
            issues.append((f"algorithm.{field}", f"policy_loss={a.policy_loss} does not take it (a loss that "
                           f"does: {declared_elsewhere[field]}); set it to null", value))
    return issues


def algorithm_issues(cfg: Any) -> list[Issue]:
    """Every problem of the policy loss, advantage estimator and rollout correction ``cfg`` names.

    Args:
        cfg: a loaded config whose ``plugins`` are imported (names they register are known).

    Returns:
        ``(key, message, value)`` for each problem; empty when all resolve and fit.
    """
    a, issues = cfg.algorithm, list[Issue]()
    loss = _entry(POLICY_LOSSES, a.policy_loss, issues)
    if loss is not None:
        issues += _loss_issues(loss, a)
    estimator = _entry(ADVANTAGE_ESTIMATORS, a.advantage_estimator, issues)
    if estimator is not None:
        problem = binding_problem(estimator.fn, None, None, **estimator.keywords(a))
        if problem:
            issues.append(("algorithm.advantage_estimator", "an advantage estimator is called as "
                           f"fn(rewards, group_ids, **hyperparameters): {problem}", a.advantage_estimator))
        size = cfg.rollout.group_size
        if size < estimator.min_group_size:
            issues.append(("rollout.group_size", f"advantage_estimator={a.advantage_estimator} needs >= "
                           f"{estimator.min_group_size} trajectories per prompt (group-relative)", size))
    if a.rollout_correction != "none":
        correction = _entry(ROLLOUT_CORRECTIONS, a.rollout_correction, issues)
        problem = None if correction is None else binding_problem(correction.fn, None, None, None,
                                                                  **correction.keywords(a))
        if problem:
            issues.append(("algorithm.rollout_correction", "a rollout correction is called as fn(old_logprobs, "
                           f"rollout_logprobs, loss_mask, **hyperparameters): {problem}", a.rollout_correction))
    return issues
