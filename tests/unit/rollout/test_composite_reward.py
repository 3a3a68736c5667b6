"""Composite reward: weights follow their schedule over steps, each term is logged
(``reward/<term>``), the sum is the weighted sum, and the terms match their formulas."""
import json

import pytest
import torch
from rollout_scripted import Reply

from megarl.config.schema import AgentConfig, RolloutConfig, SamplingConfig
from megarl.rollout.manager import RolloutManager
from megarl.rollout.rewards.composite import WeightSchedule
from megarl.rollout.rewards.reward_registry import build_reward
from megarl.rollout.rewards.terms import normalize_answer
from megarl.rollout.types import Trajectory

TERMS = {
    "outcome": {"fn": "exact_match", "kwargs": {"answer_key": "answer"}},
    "format": {"fn": "answer_format", "weight": [[0, 0.5], [4, 0.0]]},
    "tools": {"fn": "tool_success_rate", "weight": 0.2},
    "turns": {"fn": "turn_penalty", "kwargs": {"free_turns": 1}, "weight": [[2, 0.0], [6, 0.4]]},
}


def test_weight_schedule_is_piecewise_linear_and_held_outside():
    s = WeightSchedule([[0, 0.5], [4, 0.0], [8, 1.0]])
    assert [s(k) for k in (-1, 0, 1, 2, 4, 6, 8, 100)] == pytest.approx([0.5, 0.5, 0.375, 0.25, 0.0, 0.5, 1.0, 1.0])
    assert WeightSchedule(0.3)(1000) == 0.3
    for bad in ([[0, 1], [0, 2]], [], "x", [[0]]):
        with pytest.raises(ValueError, match="terms.t.weight"):
            WeightSchedule(bad, "rollout.reward_kwargs.terms.t.weight")
    with pytest.raises(ValueError, match=r"terms.x: expected \{fn, kwargs, weight\}"):
        build_reward("composite", terms={"x": {"weight": 1}})
    with pytest.raises(ValueError, match="terms.x: .*unknown reward 'nope'"):
        build_reward("composite", terms={"x": {"fn": "nope"}})


@pytest.mark.timeout(120)
async def test_weights_follow_the_schedule_and_every_term_is_logged(tokenizer, scripted_engine):
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "3 + 4"}}) + "\n</tool_call>"
    finals = ["<answer>The seven!</answer>", "<answer>eight</answer>", "seven", "<answer>Seven</answer>"]
    counter = iter(range(10 ** 6))

    def script(ids, turn):
        return Reply(call) if turn == 0 else Reply(finals[next(counter) % 4])

    rollout = RolloutConfig(group_size=4, num_prompts_per_step=1, agent=AgentConfig(max_turns=3),
                            sampling=SamplingConfig(max_new_tokens=64), tools={"calculator": {}},
                            reward="composite", reward_kwargs={"terms": TERMS})
    manager = RolloutManager(scripted_engine(script), tokenizer, rollout, filter_zero_variance=False)
    expected_terms = {"The seven!": (1, 1), "eight": (0, 1), "seven": (0, 0), "Seven": (1, 1)}
    for step in (0, 2, 4, 6):
        manager.policy_version = step
        batch = await manager.generate_groups(iter([{"question": "3 + 4 in words?", "answer": "seven"}]))
        weights = {"outcome": 1.0, "format": max(0.0, 0.5 - 0.125 * step), "tools": 0.2,
                   "turns": max(0.0, 0.1 * (step - 2))}
        trajectories = batch.groups[0].trajectories
        values = []
        for t in trajectories:
            text = t.metadata["final_text"]
            outcome, fmt = expected_terms[text.replace("<answer>", "").replace("</answer>", "")]
            v = {"outcome": outcome, "format": fmt, "tools": 1.0, "turns": -1.0}
            assert t.metadata["reward_terms"] == v and t.metadata["reward_weights"] == pytest.approx(weights)
            assert t.reward == pytest.approx(sum(weights[k] * v[k] for k in v))
            values.append(v)
        for name in TERMS:
            assert batch.metrics[f"reward/{name}_weight"] == pytest.approx(weights[name])
            assert batch.metrics[f"reward/{name}"] == pytest.approx(sum(v[name] for v in values) / len(values))
        assert batch.metrics["rollout/reward_mean"] == pytest.approx(
            sum(t.reward for t in trajectories) / len(trajectories))


def _traj(num_model_tokens, **meta):
    n = num_model_tokens + 3  # plus 3 tool tokens (loss_mask 0)
    mask = torch.tensor([1] * num_model_tokens + [0] * 3)
    return Trajectory(prompt_ids=torch.zeros(2, dtype=torch.int64), response_ids=torch.zeros(n, dtype=torch.int64),
                      loss_mask=mask, rollout_logprobs=torch.zeros(n), metadata=meta, num_turns=3)


def test_terms_follow_their_formulas():
    # DAPO eq. 13 with L_max = 100, L_cache = 20: 0 up to 80, linear to -1 at 100, -1 beyond.
    overlong = build_reward("overlong_penalty", max_tokens=100, buffer_tokens=20)
    assert [overlong(_traj(n), {}) for n in (10, 80, 81, 90, 100, 101)] == pytest.approx(
        [0.0, 0.0, -0.05, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer_tokens must be in"):
        build_reward("overlong_penalty", max_tokens=10, buffer_tokens=20)
    rate = build_reward("tool_success_rate", no_calls_value=0.5)
    assert rate(_traj(1, tool_calls=4, tool_errors=1), {}) == 0.75 and rate(_traj(1), {}) == 0.5
    assert build_reward("turn_penalty", free_turns=1)(_traj(1), {}) == -2.0
    em = build_reward("exact_match")
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    sample = {"answer": ["Paris", "City of Light"]}
    assert em(_traj(1, final_text="so <answer>x</answer> then <answer>the city of light.</answer>"), sample) == 1.0
    assert em(_traj(1, final_text="Paris"), sample) == 0.0  # no tag: no answer
    assert build_reward("exact_match", require_tag=False)(_traj(1, final_text="Paris"), sample) == 1.0
    with pytest.raises(KeyError, match="no 'answer' field"):
        em(_traj(1, final_text="<answer>a</answer>"), {})
