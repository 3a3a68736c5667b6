"""The judge reward against a real SGLang CPU server (the shared tiny-model session server): the
rubric reaches the model, its ``Score: N`` is parsed and scaled, concurrent calls are batched, and
failures (down, slow, unparsable) raise a counted JudgeError instead of a silent 0."""
import asyncio
import socket

import pytest
import torch

from megarl.rollout.rewards.judge import JudgeError, parse_score
from megarl.rollout.rewards.reward_registry import build_reward
from megarl.rollout.types import Trajectory

pytestmark = pytest.mark.timeout(300)


def traj(answer):
    return Trajectory(prompt_ids=torch.zeros(1, dtype=torch.int64), response_ids=torch.zeros(1, dtype=torch.int64),
                      loss_mask=torch.ones(1, dtype=torch.int64), rollout_logprobs=torch.zeros(1),
                      metadata={"final_text": answer})


def test_parse_score_takes_the_last_score():
    assert parse_score("Reasoning... score: 3. Final Score: 7") == 7.0
    assert parse_score("Score = 8.5") == 8.5 and parse_score("seven") is None


async def test_judge_scores_through_a_real_sglang_server(sglang_url):
    sample = {"question": "Capital of France?", "answer": "Paris"}
    for api in ("chat", "completions"):
        judge = build_reward("judge", url=sglang_url, api=api, constrain=True, max_tokens=8)
        scores = await asyncio.gather(*(judge(traj(f"Paris {i}"), sample) for i in range(6)))
        # Constrained decoding forces "Score: N" with N in 0..10; the reward is N / 10.
        assert all(s in {n / 10 for n in range(11)} for s in scores), scores
        m = judge.drain_metrics()
        assert m["judge/calls_sum"] == 6 and m["judge/failures_sum"] == 0 and m["judge/latency_s_mean"] > 0
        if api == "completions":
            assert m["judge/http_requests_sum"] < 6  # coalesced into batched /v1/completions requests
        else:
            assert m["judge/http_requests_sum"] == 6
        await judge.close()
    # The same judge as a term of a composite reward, with the rubric filled from the sample.
    composite = build_reward("composite", terms={
        "outcome": {"fn": "exact_match", "kwargs": {"require_tag": False}},
        "judge": {"fn": "judge", "kwargs": {"url": sglang_url, "constrain": True}, "weight": 0.5}})
    t = traj("Paris")
    reward = await composite(t, sample)
    assert reward == pytest.approx(1.0 + 0.5 * t.metadata["reward_terms"]["judge"])
    assert composite.drain_metrics()["judge/calls_sum"] == 1
    await composite.close()


async def test_unparsable_reply_is_a_counted_failure_not_a_zero(sglang_url):
    # Unconstrained, the random tiny model does not write "Score: N": every attempt fails to parse.
    judge = build_reward("judge", url=sglang_url, constrain=False, max_tokens=4, retries=1)
    with pytest.raises(JudgeError, match="after 2 attempts: no 'Score: N' in the reply"):
        await judge(traj("Paris"), {"question": "q", "answer": "Paris"})
    m = judge.drain_metrics()
    assert m["judge/failures_sum"] == 1 and m["judge/retries_sum"] == 1 and m["judge/http_requests_sum"] == 2
    await judge.close()


async def test_down_or_slow_judge_is_a_counted_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = build_reward("judge", url=f"http://127.0.0.1:{port}", retries=1)
    with pytest.raises(JudgeError, match="ClientConnectorError"):
        await down(traj("x"), {})
    assert down.drain_metrics()["judge/failures_sum"] == 1
    await down.close()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        slow = build_reward("judge", url=f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3, retries=0)
        with pytest.raises(JudgeError, match="failed after 1 attempts: .*Timeout"):
            await slow(traj("x"), {})
        await slow.close()
