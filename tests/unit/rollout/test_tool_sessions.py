"""Stateful tools: one session per trajectory and tool, created on first call with the trajectory's
id and row, shared by its later calls, released exactly once however the trajectory ends (answer,
engine abort, over-sampling cancellation, tool timeout, tool crash, engine crash)."""
from __future__ import annotations

import asyncio
import json

import pytest
from rollout_scripted import Reply

from megarl.config.schema import AgentConfig, RolloutConfig, SamplingConfig
from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
from megarl.rollout.manager import RolloutManager
from megarl.rollout.template import ChatTemplate
from megarl.rollout.tools.calls import ToolCallParser
from megarl.rollout.tools.sessions import ToolSession, ToolSessions, is_stateful
from megarl.rollout.types import RolloutStatus


class Counter:
    """A stateful tool: ``add`` adds to a per-trajectory total; records every create/call/release."""

    name = "add"
    schema = {"type": "function", "function": {
        "name": "add", "description": "add to the running total",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}

    def __init__(self, *, call_delay_s: float = 0.0, fail_on: int | None = None, create_delay_s: float = 0.0):
        self.call_delay_s, self.fail_on, self.create_delay_s = call_delay_s, fail_on, create_delay_s
        self.created: list[tuple[str, dict]] = []
        self.released: list[tuple[str, object]] = []
        self.live: dict[str, dict] = {}

    async def create(self, session: ToolSession) -> None:
        self.created.append((session.trajectory_id, dict(session.sample)))
        session.state = {"total": 0, "resource": object()}
        self.live[session.trajectory_id] = session.state
        await asyncio.sleep(self.create_delay_s)

    async def release(self, session: ToolSession) -> None:
        self.released.append((session.trajectory_id, session.state))
        self.live.pop(session.trajectory_id, None)

    async def __call__(self, arguments, *, session: ToolSession) -> str:
        if arguments["n"] == self.fail_on:
            raise RuntimeError("sandbox crashed")
        await asyncio.sleep(self.call_delay_s)
        session.state["total"] += arguments["n"]
        return f"total {session.state['total']} for {session.sample['question']}"


def call(n):
    return "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"n": n}}) + "\n</tool_call>"


def make_ctx(tokenizer, engine, tool, **limits):
    tools = {"add": tool}
    template = ChatTemplate(tokenizer, [tool.schema])
    limits = {"max_turns": 4, "max_response_tokens": 1024, "max_context_tokens": 4096, "tool_timeout_s": 5.0, **limits}
    return AgentContext(engine=engine, template=template, tools=tools, parser=ToolCallParser(tools),
                        sampling_params={"temperature": 1.0, "max_new_tokens": 200}, **limits)


async def run(ctx, question="q?"):
    state = new_state(ctx, ctx.template.prompt_ids([{"role": "user", "content": question}]),
                      {"question": question, "answer": "7"}, group_id=3)
    return state, await run_agent(tool_agent, ctx, state)


def observations(tokenizer, traj):
    return tokenizer.decode(traj.response_ids[traj.loss_mask == 0].tolist())


def assert_released_once(tool):
    assert sorted(t for t, _ in tool.released) == sorted(t for t, _ in tool.created), (tool.created, tool.released)
    assert not tool.live


@pytest.mark.timeout(60)
async def test_one_session_per_trajectory_shared_by_its_calls(tokenizer, scripted_engine):
    tool = Counter()
    turns = [call(2), call(3) + "\n" + call(4), "\\boxed{9}"]
    ctx = make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(turns[k])), tool)
    (s1, t1), (s2, t2) = await asyncio.gather(run(ctx, "first?"), run(ctx, "second?"))
    for state, traj, question in ((s1, t1, "first?"), (s2, t2, "second?")):
        assert traj.status == RolloutStatus.COMPLETED and traj.metadata["tool_errors"] == 0
        text = observations(tokenizer, traj)
        # 2, then 3 and 4 concurrently in one turn: the same session, created once.
        assert f"total 2 for {question}" in text and f"total 9 for {question}" in text
        assert [q for t, q in tool.created if t == state.session_id] == [{"question": question, "answer": "7"}]
    assert len(tool.created) == 2 and len({t for t, _ in tool.created}) == 2
    assert all(state["total"] == 9 for _, state in tool.released)
    assert_released_once(tool)


@pytest.mark.timeout(60)
async def test_a_trajectory_that_never_calls_the_tool_creates_nothing(tokenizer, scripted_engine):
    tool = Counter()
    _, traj = await run(make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply("\\boxed{1}")), tool))
    assert traj.status == RolloutStatus.COMPLETED and tool.created == [] and tool.released == []


@pytest.mark.timeout(60)
async def test_released_after_a_tool_timeout(tokenizer, scripted_engine):
    tool = Counter(call_delay_s=30)
    turns = [call(1), "\\boxed{1}"]
    _, traj = await run(make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(turns[k])), tool, tool_timeout_s=0.3))
    assert "timed out after 0.3 s" in observations(tokenizer, traj)
    assert traj.status == RolloutStatus.COMPLETED and len(tool.created) == 1
    assert_released_once(tool)


@pytest.mark.timeout(60)
async def test_released_when_create_itself_times_out(tokenizer, scripted_engine):
    tool = Counter(create_delay_s=30)
    turns = [call(1), "\\boxed{1}"]
    _, traj = await run(make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(turns[k])), tool, tool_timeout_s=0.3))
    assert "timed out" in observations(tokenizer, traj) and len(tool.created) == 1
    assert_released_once(tool)


@pytest.mark.timeout(60)
async def test_released_after_the_tool_crashes(tokenizer, scripted_engine):
    tool = Counter(fail_on=13)
    turns = [call(13), "\\boxed{1}"]
    _, traj = await run(make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(turns[k])), tool))
    assert "add failed: RuntimeError: sandbox crashed" in observations(tokenizer, traj)
    assert_released_once(tool)


@pytest.mark.timeout(60)
async def test_released_when_the_engine_crashes(tokenizer, scripted_engine):
    tool = Counter()

    def script(ids, k):
        if k == 1:
            raise ConnectionError("engine died")
        return Reply(call(5))
    _, traj = await run(make_ctx(tokenizer, scripted_engine(script), tool))
    assert traj.status == RolloutStatus.ERROR and len(tool.created) == 1
    assert_released_once(tool)


@pytest.mark.timeout(60)
async def test_released_when_cancelled_mid_call(tokenizer, scripted_engine):
    tool = Counter(call_delay_s=30)
    ctx = make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(call(1))), tool, tool_timeout_s=60)
    task = asyncio.ensure_future(run(ctx))
    while not tool.created:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_released_once(tool)


def rollout_config(**overrides):
    agent = AgentConfig(name="tool_agent", max_turns=3, max_response_tokens=512, max_context_tokens=2048)
    base = dict(group_size=2, num_prompts_per_step=1, over_sample_prompts=1, agent=agent,
                sampling=SamplingConfig(max_new_tokens=128), tools={}, reward="gsm8k",
                reward_kwargs={"executor": "inline"})
    return RolloutConfig(**{**base, **overrides})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partial", [False, True])
async def test_released_when_the_manager_aborts_the_excess(tokenizer, scripted_engine, partial):
    """Over-sampling: the slow group is aborted on the engine mid-turn after its tool ran."""
    tool = Counter()

    def script(ids, turn):
        slow = "slow" in tokenizer.decode(ids)
        if turn == 0:
            return Reply(call(1))
        return Reply("thinking for a long while \\boxed{7}", delay_s=60) if slow else Reply("\\boxed{7}")

    manager = RolloutManager(scripted_engine(script), tokenizer, rollout_config(partial_rollouts=partial),
                             tools={"add": tool}, filter_zero_variance=False)
    batch = await manager.generate_groups(iter([{"question": "fast?", "answer": "#### 7"},
                                                {"question": "slow?", "answer": "#### 7"}]))
    assert len(batch.groups) == 1 and len(tool.created) == 4  # both groups called the tool
    assert_released_once(tool)  # the aborted (or parked) trajectories too


async def test_release_errors_are_counted_not_raised():
    class Broken:
        name = "broken"
        schema = {}

        async def create(self, session):
            session.state = 1

        async def release(self, session):
            raise OSError("container already gone")

        async def __call__(self, arguments, *, session):
            return "ok"

    tool = Broken()
    from megarl.rollout.tools.calculator import CalculatorTool

    assert is_stateful(tool) and not is_stateful(CalculatorTool())  # a plain tool is called as before
    meta: dict = {}
    sessions = ToolSessions(trajectory_id="t", group_id=0, sample={}, metadata=meta)
    assert await sessions.bind({"broken": tool})["broken"]({}) == "ok"
    await sessions.release_all()
    await sessions.release_all()  # a second release finds nothing left
    assert meta["tool_release_errors"] == 1
