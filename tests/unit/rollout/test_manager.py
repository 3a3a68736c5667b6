"""RolloutManager: groups of G, over-sampling with abort, zero-variance filter, partial rollouts, metrics."""
import json
import time

import pytest
from rollout_scripted import Reply

from megarl.config.schema import AgentConfig, RolloutConfig, SamplingConfig
from megarl.rollout.manager import RolloutManager
from megarl.rollout.types import RolloutStatus


def config(**overrides):
    agent = AgentConfig(name="tool_agent", max_turns=3, max_response_tokens=512, max_context_tokens=2048)
    base = dict(group_size=4, num_prompts_per_step=2, over_sample_prompts=0, agent=agent,
                sampling=SamplingConfig(max_new_tokens=128), tools={"calculator": {}},
                reward="gsm8k", reward_kwargs={"executor": "inline"})
    return RolloutConfig(**{**base, **overrides})


def prompts(*questions):
    return [{"question": q, "answer": "#### 7"} for q in questions]


def calc_then_answer(tokenizer, answers):
    """Turn 1 calls the calculator; turn 2 answers with the next value from ``answers``."""
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "3 + 4"}}) + "\n</tool_call>"
    counter = iter(range(10 ** 6))

    def script(ids, turn):
        if turn == 0:
            return Reply(call)
        return Reply(f"\\boxed{{{answers(tokenizer.decode(ids), next(counter))}}}")
    return script


@pytest.mark.timeout(60)
async def test_groups_rewards_and_metrics(tokenizer, scripted_engine):
    engine = scripted_engine(calc_then_answer(tokenizer, lambda text, i: 7 if i % 2 else 8))
    manager = RolloutManager(engine, tokenizer, config())
    batch = await manager.generate_groups(iter(prompts("q one?", "q two?", "q unused?")))
    assert len(batch.groups) == 2 and {g.group_id for g in batch.groups} == {0, 1}
    for group in batch.groups:
        assert len(group.trajectories) == 4
        for traj in group.trajectories:
            assert traj.group_id == group.group_id and traj.status == RolloutStatus.COMPLETED
            assert traj.reward == (1.0 if traj.metadata["final_text"] == "\\boxed{7}" else 0.0)
        # Members share the prompt rendered once; they are separate sessions.
        assert len({tuple(t.prompt_ids.tolist()) for t in group.trajectories}) == 1
    assert len({c["session_id"] for c in engine.calls}) == 8 and len(engine.calls) == 16
    m = batch.metrics
    inputs = sum(len(c["input_ids"]) for c in engine.calls)
    cached = sum(max(0, len(c["input_ids"]) - 8) for c in engine.calls)
    assert m["rollout/prefix_cache_hit_rate"] == pytest.approx(cached / inputs)
    assert m["rollout/turns_mean"] == 2 and m["rollout/tool_calls_mean"] == 1
    assert m["rollout/tool_errors_mean"] == 0 and m["rollout/finish_reason/stop_frac"] == 1
    assert m["rollout/status/completed_frac"] == 1 and m["rollout/num_groups"] == 2
    generated = sum(t.num_model_tokens for g in batch.groups for t in g.trajectories)
    assert m["rollout/generated_tokens_sum"] == generated and m["rollout/tokens_per_s"] > 0
    assert m["rollout/response_tokens_min"] <= m["rollout/response_tokens_p50"] <= m["rollout/response_tokens_max"]
    assert m["rollout/reward_mean"] == pytest.approx(0.5)


@pytest.mark.timeout(60)
async def test_zero_variance_groups_are_dropped_and_replaced(tokenizer, scripted_engine):
    # "easy" prompts are always answered right (zero variance); the others half right.
    engine = scripted_engine(calc_then_answer(
        tokenizer, lambda text, i: 7 if "easy" in text or i % 2 else 8))
    manager = RolloutManager(engine, tokenizer, config(over_sample_prompts=2))
    batch = await manager.generate_groups(iter(prompts("easy a?", "hard b?", "easy c?", "hard d?")))
    assert len(batch.groups) == 2
    assert batch.metrics["rollout/groups_dropped_zero_variance"] == 2
    for group in batch.groups:
        assert len({t.reward for t in group.trajectories}) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partial", [False, True])
async def test_over_sampling_aborts_excess_and_partial_rollouts_resume(tokenizer, scripted_engine, partial):
    def script(ids, turn):
        slow = "slow" in tokenizer.decode(ids)
        if slow and turn == 0:  # aborted mid-turn by the manager
            return Reply("I will think about this for a long time and then answer \\boxed{7}",
                         delay_s=60, weight_version="0")
        if slow:
            return Reply(" and so \\boxed{7}", weight_version="1")
        return Reply("\\boxed{7}" if turn % 2 else "\\boxed{8}", weight_version="0")

    engine = scripted_engine(script)
    manager = RolloutManager(engine, tokenizer, config(over_sample_prompts=2, partial_rollouts=partial,
                                                       group_size=2),
                             filter_zero_variance=False)
    start = time.monotonic()
    batch = await manager.generate_groups(iter(prompts("fast 1?", "slow 2?", "fast 3?", "slow 4?")))
    assert time.monotonic() - start < 10  # the excess was aborted, not waited for
    assert len(batch.groups) == 2 and "abort" in engine.paused_modes
    assert all(t.status == RolloutStatus.COMPLETED for g in batch.groups for t in g.trajectories)
    assert batch.metrics["rollout/groups_carried_over"] == (2 if partial else 0)

    manager.policy_version = 1  # a weight update happened
    nxt = await manager.generate_groups(iter(prompts("fast 5?", "fast 6?")))
    assert len(nxt.groups) == 2
    if not partial:
        assert nxt.metrics["rollout/groups_resumed"] == 0
        return
    assert nxt.metrics["rollout/groups_resumed"] == 2
    resumed = [t for g in nxt.groups for t in g.trajectories]
    assert {t.group_id for t in resumed} == {1, 3}  # the slow prompts, resumed first
    for traj in resumed:
        versions = traj.token_policy_versions
        assert traj.status == RolloutStatus.COMPLETED and versions is not None
        n_old = int((versions == 0).sum())
        assert 0 < n_old < traj.num_response_tokens and versions[n_old:].eq(1).all()
        assert traj.policy_version == 0 and traj.reward == 1.0
        assert traj.metadata["final_text"].endswith("and so \\boxed{7}")


@pytest.mark.timeout(60)
async def test_failed_trajectories_drop_their_group(tokenizer, scripted_engine):
    def script(ids, turn):
        if "broken" in tokenizer.decode(ids):
            raise ConnectionError("engine gone")
        return Reply("\\boxed{7}" if turn % 2 == 0 else "\\boxed{1}")

    manager = RolloutManager(scripted_engine(script), tokenizer, config(group_size=2),
                             filter_zero_variance=False)
    batch = await manager.generate_groups(iter(prompts("broken?", "fine?")))
    assert len(batch.groups) == 1 and batch.metrics["rollout/groups_dropped_error"] == 1


def test_bad_config_names_the_field(tokenizer, scripted_engine):
    engine = scripted_engine(lambda ids, turn: Reply("x"))
    with pytest.raises(ValueError, match="rollout.agent.name"):
        RolloutManager(engine, tokenizer, config(agent=AgentConfig(name="nope")))
    with pytest.raises(ValueError, match="rollout.tools.nope"):
        RolloutManager(engine, tokenizer, config(tools={"nope": {}}))
    manager = RolloutManager(engine, tokenizer, config())
    with pytest.raises(KeyError, match="'question'"):
        manager.messages_for({"prompt": "x"})


@pytest.mark.timeout(60)
async def test_engine_without_abort_falls_back_to_cancellation(tokenizer, scripted_engine):
    def script(ids, turn):
        if "slow" in tokenizer.decode(ids) and turn == 0:
            return Reply("a long answer \\boxed{7}", delay_s=60)
        return Reply("\\boxed{7}")

    engine = scripted_engine(script)

    async def refuse(mode="retract"):
        raise RuntimeError("pause not supported")
    engine.pause = refuse
    manager = RolloutManager(engine, tokenizer, config(over_sample_prompts=1, partial_rollouts=True,
                                                       group_size=2), filter_zero_variance=False)
    start = time.monotonic()
    batch = await manager.generate_groups(iter(prompts("fast 1?", "fast 2?", "slow 3?")))
    assert time.monotonic() - start < 10 and len(batch.groups) == 2
    nxt = await manager.generate_groups(iter(prompts("fast 4?")), num_groups=1)
    (group,) = nxt.groups
    assert group.group_id == 2
    for traj in group.trajectories:  # the cancelled turn was redone from its start, counted once
        assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 1
        assert traj.metadata["final_text"] == "\\boxed{7}" and traj.metadata["num_generate_calls"] == 1


@pytest.mark.timeout(60)
async def test_concurrent_forks_stop_only_their_own_excess_and_share_carried_groups(tokenizer, scripted_engine):
    """Async RL runs several steps' rollouts at once: one step ending its over-sampled groups must
    not abort another step's requests, and partial groups are carried to whichever step is next."""
    import asyncio

    def script(ids, turn):
        text = tokenizer.decode(ids)
        if "slow" in text and turn == 0:
            return Reply("thinking for a long while \\boxed{7}", delay_s=60, weight_version="0")
        if "steady" in text:  # the other step's groups: a few seconds each
            return Reply("\\boxed{7}" if turn % 2 else "\\boxed{8}", delay_s=1.5, weight_version="0")
        return Reply("\\boxed{7}" if turn % 2 else "\\boxed{8}", weight_version="0")

    engine = scripted_engine(script)
    base = RolloutManager(engine, tokenizer, config(over_sample_prompts=1, partial_rollouts=True, group_size=2),
                          filter_zero_variance=False)
    step_a, step_b = base.fork(exclusive=False), base.fork(exclusive=False)
    step_a.policy_version, step_b.policy_version = 3, 4
    run_b = asyncio.ensure_future(step_b.generate_groups(iter(prompts("steady 1?", "steady 2?"))))
    batch_a = await step_a.generate_groups(iter(prompts("fast 1?", "fast 2?", "slow 3?")))
    assert len(batch_a.groups) == 2 and batch_a.metrics["rollout/groups_carried_over"] == 1
    assert "abort" not in engine.paused_modes  # no engine-wide abort while step b runs
    batch_b = await run_b
    assert len(batch_b.groups) == 2 and all(t.status == RolloutStatus.COMPLETED
                                            for g in batch_b.groups for t in g.trajectories)
    assert {t.policy_version for g in batch_b.groups for t in g.trajectories} == {0}  # engine-reported
    assert step_a.ctx.stop_requested and not step_b.ctx.stop_requested  # a's stop is a's alone
    # the carried group is resumed by the next fork (shared), not by the one that parked it only
    nxt = base.fork()
    assert len(base._carry) == 1
    carried_id = base._carry[0].group_id
    batch_c = await nxt.generate_groups(iter(prompts("fast 4?")), num_groups=1)
    assert batch_c.metrics["rollout/groups_resumed"] == 1
    assert [g.group_id for g in batch_c.groups] == [carried_id]
