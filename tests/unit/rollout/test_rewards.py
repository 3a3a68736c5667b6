"""GSM8K reward through math-verify; registry; async rewards run concurrently."""
import asyncio

import pytest
import torch

from megarl.rollout.rewards.gsm8k_answer import gsm8k_reference
from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY, build_reward, compute_reward
from megarl.rollout.types import Trajectory


def trajectory(final_text):
    empty = torch.zeros(0, dtype=torch.int64)
    return Trajectory(prompt_ids=empty, response_ids=empty, loss_mask=empty,
                      rollout_logprobs=torch.zeros(0), metadata={"final_text": final_text})


RAW_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"

CASES = [
    ("So the total is \\boxed{1072}.", RAW_ANSWER, 1.0),
    ("The answer is 1,072 clips.", RAW_ANSWER, 1.0),       # last number, thousands separator
    ("\\boxed{1072.0}", "1072", 1.0),                       # already converted row
    ("I think \\boxed{1070}", RAW_ANSWER, 0.0),
    ("No idea.", RAW_ANSWER, 0.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
]


def test_reference_extraction():
    assert gsm8k_reference(RAW_ANSWER) == "1072" and gsm8k_reference("72") == "72"


@pytest.mark.parametrize("text,answer,expected", CASES)
async def test_gsm8k_inline(text, answer, expected):
    reward = build_reward("gsm8k", executor="inline")
    assert await compute_reward(reward, trajectory(text), {"answer": answer}) == expected


@pytest.mark.timeout(120)
async def test_gsm8k_process_pool_concurrent_and_format_bonus():
    reward = build_reward("gsm8k", format_weight=0.1, num_workers=1)
    try:
        values = await asyncio.gather(*(compute_reward(reward, trajectory(t), {"answer": a})
                                        for t, a, _ in CASES))
    finally:
        reward.close()
    expected = [e + (0.1 if "\\boxed{" in t else 0.0) for t, _, e in CASES]
    assert values == pytest.approx(expected)


async def test_errors_name_the_field():
    assert "gsm8k" in REWARD_REGISTRY
    with pytest.raises(ValueError, match="rollout.reward: unknown reward"):
        build_reward("nope")
    with pytest.raises(ValueError, match="rollout.reward_kwargs"):
        build_reward("gsm8k", bogus=1)
    with pytest.raises(ValueError, match="executor"):
        build_reward("gsm8k", executor="thread")
    reward = build_reward("gsm8k", executor="inline")
    with pytest.raises(KeyError, match="no 'answer' field"):
        await reward(trajectory("1"), {"solution": "1"})


async def test_sync_reward_functions_are_accepted():
    assert await compute_reward(lambda traj, sample: 0.5, trajectory(""), {}) == 0.5
