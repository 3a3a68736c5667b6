"""The one registry mechanism (megarl.registry.Registry) behind every extension point: a name holds one
entry, registering it again is harmless, an import path resolves to an entry, errors name the field."""
from __future__ import annotations

import pytest

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    PolicyLoss,
    register_advantage_estimator,
    register_policy_loss,
    register_rollout_correction,
)
from megarl.data.datasets import DATASET_REGISTRY, register_dataset
from megarl.data.demonstrations import DEMONSTRATION_BUILDERS, register_demonstrations
from megarl.plugins import PluginError
from megarl.registry import Registry
from megarl.rollout.agent import AGENT_REGISTRY, register_agent
from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY, register_reward
from megarl.rollout.tools.tool_registry import TOOL_REGISTRY, register_tool


def first():
    pass


def second():
    pass


def test_registry_keeps_one_entry_per_name():
    registry = Registry("thing", "section.thing")
    assert registry.register("x")(first) is first
    assert registry.register("x")(first) is first  # the same object again: a re-import
    with pytest.raises(ValueError, match="thing 'x' is already registered"):
        registry.register("x")(second)
    assert registry == {"x": first}
    assert registry.resolve("x") is first


def test_registry_resolves_import_paths_through_entry_of_and_names_the_key():
    registry = Registry("thing", "section.thing", entry_of=lambda obj: ("entry", obj))
    assert registry.resolve(f"{__name__}:second") == ("entry", second)
    assert registry.allows(f"{__name__}:second") and registry.allows("any.module:name")
    assert not registry.allows("unknown") and not registry.allows(3)
    with pytest.raises(PluginError, match=r"section.thing: unknown thing 'unknown': registered things are \(none\)"):
        registry.resolve("unknown")
    with pytest.raises(PluginError, match="other.key: module .* has no attribute 'missing'"):
        registry.resolve(f"{__name__}:missing", key="other.key")
    assert registry.get_entry("unknown") is None


def test_a_refused_import_path_object_is_an_error_naming_the_field():
    with pytest.raises(PluginError, match=r"algorithm.policy_loss: 'math:pi' is not a policy loss: .*neither a "
                                          r"function nor a PolicyLoss"):
        POLICY_LOSSES.resolve("math:pi")


def test_an_import_path_to_a_function_is_a_loss_without_declared_hyperparameters():
    loss = POLICY_LOSSES.resolve(f"{__name__}:first")
    assert loss == PolicyLoss(first) and loss.hyperparameters == {} and loss.ratio_level == "token"
    entry = PolicyLoss(second, hyperparameters={"scale": "clip_high"})
    assert PolicyLoss.of(entry) is entry  # an entry given by import path is used as it is


@pytest.mark.parametrize("register, registry, kind", [
    (register_tool, TOOL_REGISTRY, "tool"), (register_reward, REWARD_REGISTRY, "reward"),
    (register_agent, AGENT_REGISTRY, "agent loop"), (register_dataset, DATASET_REGISTRY, "dataset"),
    (register_demonstrations, DEMONSTRATION_BUILDERS, "demonstration builder"),
    (register_policy_loss, POLICY_LOSSES, "policy loss"),
    (register_advantage_estimator, ADVANTAGE_ESTIMATORS, "advantage estimator"),
    (register_rollout_correction, ROLLOUT_CORRECTIONS, "rollout correction")])
def test_every_registry_refuses_a_second_object_under_a_taken_name(register, registry, kind):
    assert isinstance(registry, Registry) and registry.kind == kind
    name = next(iter(registry))
    held = registry[name]
    with pytest.raises(ValueError, match=f"{kind} '{name}' is already registered"):
        register(name)(lambda *a, **k: None)
    assert registry[name] is held
