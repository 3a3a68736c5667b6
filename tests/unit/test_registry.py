"""The registries' decorator: a name holds one object; registering it again is harmless."""
from __future__ import annotations

import pytest

from megarl.data.datasets import DATASET_REGISTRY, register_dataset
from megarl.data.demonstrations import DEMONSTRATION_BUILDERS, register_demonstrations
from megarl.registry import registrar
from megarl.rollout.agent import AGENT_REGISTRY, register_agent
from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY, register_reward
from megarl.rollout.tools.tool_registry import TOOL_REGISTRY, register_tool


def test_registrar_keeps_one_object_per_name():
    registry: dict = {}

    def first():
        pass

    def second():
        pass

    assert registrar(registry, "x", "thing")(first) is first
    assert registrar(registry, "x", "thing")(first) is first  # the same object again: a re-import
    with pytest.raises(ValueError, match="thing 'x' is already registered"):
        registrar(registry, "x", "thing")(second)
    assert registry == {"x": first}


@pytest.mark.parametrize("register, registry, kind", [
    (register_tool, TOOL_REGISTRY, "tool"), (register_reward, REWARD_REGISTRY, "reward"),
    (register_agent, AGENT_REGISTRY, "agent loop"), (register_dataset, DATASET_REGISTRY, "dataset"),
    (register_demonstrations, DEMONSTRATION_BUILDERS, "demonstration builder")])
def test_every_registry_refuses_a_second_object_under_a_taken_name(register, registry, kind):
    name = next(iter(registry))
    held = registry[name]
    with pytest.raises(ValueError, match=f"{kind} '{name}' is already registered"):
        register(name)(lambda *a, **k: None)
    assert registry[name] is held
