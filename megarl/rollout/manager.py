"""RolloutManager: prompts in, ``TrajectoryGroup``s of size G out (docs/architecture.md).

One step (:meth:`RolloutManager.generate_groups`):

1. Take ``num_prompts_per_step + over_sample_prompts`` prompts (minus groups carried over from the
   previous step), render each prompt once, start G trajectory coroutines per prompt.
2. As each group finishes (rewards computed as each trajectory ends, concurrently), accept it
   unless a member failed or (dynamic sampling, ``filter_zero_variance``) its rewards are all equal.
3. Once ``num_prompts_per_step`` groups are accepted, stop the rest: every loop ends at its next
   turn boundary and in-flight requests are aborted on the engine (``pause("abort")`` then
   ``resume()``), which returns their partial turns.
4. With ``partial_rollouts``, the stopped groups (partial trajectories and finished members alike)
   are kept and resumed first by the next step, i.e. after the weight update; each token keeps the
   policy version that generated it (``Trajectory.token_policy_versions``). Without it they are
   dropped.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.agent import AgentContext, get_agent_loop, new_state, run_agent
from megarl.rollout.rewards.reward_registry import build_reward, compute_reward
from megarl.rollout.template import build_template
from megarl.rollout.tools import build_tools
from megarl.rollout.trajectory_state import TrajectoryState
from megarl.rollout.trajectory_stats import throughput_metrics, trajectory_metrics
from megarl.rollout.types import RewardFn, RolloutEngine, RolloutStatus, Tool, Trajectory, TrajectoryGroup

logger = logging.getLogger(__name__)

_FINISHED = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


@dataclass(kw_only=True)
class RolloutBatch:
    """One step's output: accepted groups (each of size G) and ``rollout/*`` metrics."""

    groups: list[TrajectoryGroup]
    metrics: dict[str, float]
    sample_text: str = ""  # one trajectory as text, for the driver's log (set by the rollout actor)


@dataclass(kw_only=True)
class _Group:
    group_id: int
    sample: dict[str, Any]
    states: list[TrajectoryState]
    trajectories: list[Trajectory | None] = field(default_factory=list)


def sampling_params_from_config(sampling: Any) -> dict[str, Any]:
    """SGLang sampling parameters from a ``SamplingConfig``."""
    params: dict[str, Any] = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
              "top_k": int(sampling.top_k), "max_new_tokens": int(sampling.max_new_tokens)}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    return params


class RolloutManager:
    """Runs the agent loop over batches of prompts and groups the trajectories.

    Args:
        engine: the engine or router generating turns.
        tokenizer: the policy's Hugging Face tokenizer (chat template included).
        rollout: a ``RolloutConfig`` (group_size, num_prompts_per_step, over_sample_prompts,
            sampling, agent, tools, reward, reward_kwargs, partial_rollouts).
        prompt_key: dataset field with the user prompt (a row may instead carry ``messages``).
        filter_zero_variance: drop groups whose rewards are all equal (dynamic sampling).
        tools: tools to use instead of building ``rollout.tools`` from the registry.
        reward_fn: reward to use instead of building ``rollout.reward``.
        eos_token_ids: ids ending a model turn (default: the tokenizer's EOS).
        abort_timeout_s: how long stopping the excess may take before its tasks are cancelled.
        return_routed_experts: record the engine's routed experts (``train.routing_replay: r3``).
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, rollout: Any, *,
                 prompt_key: str = "question", filter_zero_variance: bool = True,
                 tools: Mapping[str, Tool] | None = None, reward_fn: RewardFn | None = None,
                 eos_token_ids: set[int] | None = None, abort_timeout_s: float = 60.0,
                 return_routed_experts: bool = False) -> None:
        agent = rollout.agent
        self.loop = get_agent_loop(agent.name)
        if agent.name == "single_turn":
            tools = {}
        elif tools is None:
            tools = build_tools(dict(rollout.tools))
        self.engine = engine
        self.group_size = int(rollout.group_size)
        self.num_prompts_per_step = int(rollout.num_prompts_per_step)
        self.over_sample_prompts = int(rollout.over_sample_prompts)
        self.partial_rollouts = bool(rollout.partial_rollouts)
        self.prompt_key = prompt_key
        self.filter_zero_variance = filter_zero_variance and self.group_size > 1
        self.abort_timeout_s = abort_timeout_s
        self.reward_fn = reward_fn or build_reward(rollout.reward, **dict(rollout.reward_kwargs))
        template, parser = build_template(tokenizer, agent, tools, eos_token_ids)
        self.ctx = AgentContext(
            engine=engine, template=template, tools=tools, parser=parser,
            sampling_params=sampling_params_from_config(rollout.sampling),
            max_turns=int(agent.max_turns), max_response_tokens=int(agent.max_response_tokens),
            max_context_tokens=int(agent.max_context_tokens),
            max_tool_output_chars=int(agent.max_tool_output_chars),
            tool_timeout_s=float(agent.tool_timeout_s),
            return_routed_experts=return_routed_experts)
        self._group_ids = itertools.count()
        self._carry: list[_Group] = []
        self._generated_tokens = 0
        self.exclusive = True
        """No other rollout shares the engines (see :meth:`fork`)."""

    def fork(self, engine: RolloutEngine | None = None, *, exclusive: bool = True) -> RolloutManager:
        """A manager for one more rollout, possibly running concurrently with others (async RL).

        The fork shares the tools, reward, chat template, group-id counter and carried-over groups
        (partial rollouts), and has its own agent context: its own ``policy_version``, its own
        ``stop_requested`` and, if given, its own ``engine`` (e.g. a per-step seeded wrapper).

        Args:
            engine: the engine of the fork (default: this manager's).
            exclusive: no other rollout uses the engines meanwhile. A non-exclusive fork ends its
                over-sampled groups by aborting its own requests only (cancellation aborts each by
                ``rid``), never with the engine-wide abort that would end the other rollouts' too.
        """
        twin = copy.copy(self)
        twin.engine = engine if engine is not None else self.engine
        twin.ctx = dataclasses.replace(self.ctx, engine=twin.engine, stop_requested=False)
        twin._generated_tokens = 0
        twin.exclusive = exclusive
        return twin

    @property
    def policy_version(self) -> int:
        """Version stamped on tokens when the engine reports none (set after each weight update)."""
        return self.ctx.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.ctx.policy_version = int(version)

    def messages_for(self, sample: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Chat messages of a dataset row (``messages`` as given, else one user turn).

        Raises:
            KeyError: the row has neither ``messages`` nor ``prompt_key``.
        """
        if "messages" in sample:
            return list(sample["messages"])
        if self.prompt_key not in sample:
            raise KeyError(f"prompt row has no {self.prompt_key!r} field (fields: {sorted(sample)})")
        return [{"role": "user", "content": str(sample[self.prompt_key])}]

    def _new_group(self, sample: Mapping[str, Any]) -> _Group:
        prompt_ids = self.ctx.template.prompt_ids(self.messages_for(sample))  # rendered once
        group_id = next(self._group_ids)
        states = [new_state(self.ctx, prompt_ids, dict(sample), group_id)
                  for _ in range(self.group_size)]
        return _Group(group_id=group_id, sample=dict(sample), states=states,
                      trajectories=[None] * self.group_size)

    async def _run_member(self, group: _Group, i: int) -> Trajectory:
        state = group.states[i]
        before = state.metadata["generated_tokens"]
        try:
            traj = await run_agent(self.loop, self.ctx, state)
        finally:
            self._generated_tokens += state.metadata["generated_tokens"] - before
        if traj.status in _FINISHED:
            try:
                traj.reward = await compute_reward(self.reward_fn, traj, group.sample)
            except Exception as e:  # noqa: BLE001 - a broken reward fails one trajectory
                logger.warning("reward failed for group %d: %s", group.group_id, e)
                traj.status = RolloutStatus.ERROR
                traj.metadata["error"] = f"reward: {type(e).__name__}: {e}"
            state.status = traj.status
            group.trajectories[i] = traj
        return traj

    async def _run_group(self, group: _Group) -> list[Trajectory]:
        todo = [i for i, t in enumerate(group.trajectories) if t is None]
        await asyncio.gather(*(self._run_member(group, i) for i in todo))
        return [t if t is not None else group.states[i].to_trajectory()
                for i, t in enumerate(group.trajectories)]

    def _accept(self, trajectories: list[Trajectory], counts: dict[str, int]) -> bool:
        if any(t.status not in _FINISHED for t in trajectories):
            counts["groups_dropped_error"] += 1
            return False
        rewards = [t.reward for t in trajectories]
        if self.filter_zero_variance and max(rewards) == min(rewards):
            counts["groups_dropped_zero_variance"] += 1
            return False
        return True

    async def generate_groups(self, prompts: Iterable[Mapping[str, Any]], *,
                              num_groups: int | None = None) -> RolloutBatch:
        """Produce up to ``num_groups`` accepted groups (default ``num_prompts_per_step``).

        Args:
            prompts: dataset rows; consumed lazily: only as many as this step starts are taken.
            num_groups: groups wanted; fewer are returned when the prompts run out or too many
                groups are filtered.

        Returns:
            The accepted groups, in completion order, and the step's metrics.
        """
        target = self.num_prompts_per_step if num_groups is None else int(num_groups)
        start, self._generated_tokens = time.monotonic(), 0
        self.ctx.stop_requested = False
        carried = list(self._carry)
        self._carry.clear()  # in place: forks (concurrent rollouts) share the carried groups
        num_new = max(0, target + self.over_sample_prompts - len(carried))
        groups = carried + [self._new_group(s) for s in itertools.islice(iter(prompts), num_new)]
        tasks = {asyncio.ensure_future(self._run_group(g)): g for g in groups}
        order = {task: i for i, task in enumerate(tasks)}  # carried-over groups first
        accepted: list[TrajectoryGroup] = []
        counts = {"groups_dropped_error": 0, "groups_dropped_zero_variance": 0,
                  "groups_carried_over": 0, "groups_resumed": len(carried)}
        pending = set(tasks)
        try:
            while pending and len(accepted) < target:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=order.__getitem__):
                    group, trajectories = tasks[task], task.result()
                    if any(t.status == RolloutStatus.ABORTED for t in trajectories):
                        self._park(group, counts)  # aborted by the engine (e.g. a weight sync)
                    elif self._accept(trajectories, counts) and len(accepted) < target:
                        accepted.append(TrajectoryGroup(group_id=group.group_id,
                                                        trajectories=trajectories))
                    elif len(accepted) >= target:
                        self._park(group, counts)
            if pending:
                await self._stop_excess(pending, tasks, counts)
        finally:
            for task in pending:
                task.cancel()
        metrics = trajectory_metrics([t for g in accepted for t in g.trajectories])
        metrics.update(throughput_metrics(generated_tokens=self._generated_tokens,
                                          wall_s=time.monotonic() - start))
        metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
        metrics["rollout/num_groups"] = float(len(accepted))
        for source in (*self.ctx.tools.values(), self.reward_fn):  # own counters: search/*, judge/*
            drain = getattr(source, "drain_metrics", None)
            if drain is not None:
                metrics.update(drain())
        return RolloutBatch(groups=accepted, metrics=metrics)

    def _park(self, group: _Group, counts: dict[str, int]) -> None:
        """Keep a stopped group for the next step (partial rollouts) or drop it."""
        if self.partial_rollouts:
            self._carry.append(group)
            counts["groups_carried_over"] += 1

    async def _stop_excess(self, pending: set[asyncio.Task], tasks: dict[asyncio.Task, _Group],
                           counts: dict[str, int]) -> None:
        """End the over-sampled groups: turn-boundary stop, engine abort, then cancellation."""
        self.ctx.stop_requested = True
        # Other rollouts sharing the engines: abort only ours, by cancellation (the client aborts
        # each cancelled request by rid); the engine-wide abort would end theirs too.
        grace_s = self.abort_timeout_s if self.exclusive else 0.0
        if self.exclusive:
            try:
                await self.engine.pause("abort")
                await self.engine.resume()
            except Exception as e:  # noqa: BLE001 - cancellation below still ends them
                logger.warning("engine abort of the over-sampled requests failed (%s); cancelling", e)
                grace_s = 0.0  # cancelled requests are aborted by the client; their turn restarts
        _, still = await asyncio.wait(pending, timeout=grace_s) if grace_s else (set(), pending)
        for task in still:
            task.cancel()
        await asyncio.gather(*still, return_exceptions=True)
        for task in pending:
            self._park(tasks[task], counts)

    async def close(self) -> None:
        """Release what the reward function holds (e.g. its worker processes)."""
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result
