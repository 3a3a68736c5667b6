"""The RolloutManager as a Ray actor: engines' router, training rollouts, greedy evaluation.

Running the manager in its own (async) actor lets the driver start the rollout of step k+1 and
train step k at the same time (async mode): a remote call returns at once with a reference. The
actor also answers the driver's engine-control calls (pause / resume / flush around a weight sync,
health checks, putting a restarted engine back into service) between or during rollouts.

Determinism (``rollout.deterministic_sampling``): every generate call gets a ``sampling_seed``
derived from ``(train.seed, step, token ids of the request, occurrence)``, so a resumed run samples
exactly what an uninterrupted one would, independent of which engine or in which order requests are
served. The engines then run with ``--enable-deterministic-inference`` (see ``megarl/cluster/ray_engines.py``).

R3 routes (``Trajectory.routed_experts`` ``[P + R, L, K]`` int32, ~1.5 KB per token for
Qwen3-30B-A3B) pass neither through this actor nor through the driver: one worker per engine makes
the generate calls that ask for them, decodes and keeps them (:mod:`megarl.launch.route_workers`),
and trajectories carry references to the parts. Routes that reach this actor as tensors (none in
the run) never pass through the driver either: `RolloutWorker.generate` puts each trajectory's
routes in the Ray object store and leaves the reference in the trajectory the driver receives; the
trainer rank that trains the sequence reads it (`megarl.launch.trainer_group.TrainerWorker.prepare`).
This actor owns those objects (it put them) and lives as long as the run, so they outlive the
rollout call; a reference cannot outlive the Ray session, so a checkpoint writes them to files, one
Ray task per group, never through the driver (:mod:`megarl.launch.route_files`).
"""
from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch

from megarl.config.schema import RolloutConfig, as_megarl_config

logger = logging.getLogger(__name__)


class SeededEngine:
    """Wraps a :class:`~megarl.rollout.types.RolloutEngine`; adds a deterministic ``sampling_seed``.

    The seed of a call is a hash of the run seed, the step, the request's token ids and how many
    identical requests came before it in this step (the G members of a group send the same first
    turn; the n-th one gets occurrence n). Other calls are delegated unchanged.
    """

    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.seed = int(seed)
        self.step = 0
        self._seen: collections.Counter[bytes] = collections.Counter()

    def start_step(self, step: int) -> None:
        """Seeds of the following calls depend on ``step``; occurrence counts restart."""
        self.step = int(step)
        self._seen.clear()

    def seed_for(self, input_ids: Sequence[int]) -> int:
        """The next seed for a request with these token ids (counts the occurrence)."""
        digest = hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=16,
                                 key=f"{self.seed}:{self.step}".encode()).digest()
        occurrence = self._seen[digest]
        self._seen[digest] += 1
        mixed = hashlib.blake2b(digest + occurrence.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(mixed, "little") & (2**63 - 1)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """The wrapped engine's ``generate`` with ``sampling_seed`` set by :meth:`seed_for` (the caller's
        ``sampling_params`` are not changed).
        """
        params = {**sampling_params, "sampling_seed": self.seed_for(input_ids)}
        return await self.engine.generate(input_ids, params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _eval_rollout_config(rollout: RolloutConfig, samples_per_prompt: int = 0) -> Any:
    """The rollout section for evaluation, no over-sampling: one greedy trajectory per prompt, or
    (``samples_per_prompt > 0``) that many trajectories sampled with the training settings."""
    from omegaconf import OmegaConf

    if samples_per_prompt > 0:
        return OmegaConf.merge(rollout, {"group_size": samples_per_prompt, "over_sample_prompts": 0,
                                         "partial_rollouts": False})
    return OmegaConf.merge(rollout, {"group_size": 1, "over_sample_prompts": 0, "partial_rollouts": False,
                                     "sampling": {"temperature": 0.0}})


def put_routes(groups: Sequence[Any]) -> None:
    """Replace every trajectory's ``routed_experts`` tensor by an object-store reference (in place;
    the caller's process owns the objects)."""
    for group in groups:
        for traj in group.trajectories:
            if isinstance(traj.routed_experts, torch.Tensor):
                traj.routed_experts = ray.put(traj.routed_experts)


def _records(trajectories: Sequence[Any], rows: Sequence[dict]) -> list[dict]:
    """Each trajectory's record with the index of its prompt among ``rows`` (found by the row's
    content: the manager copies the rows; equal rows take their indices in turn)."""
    import json

    from megarl.rollout.trajectory_stats import trajectory_record

    def key(row: Any) -> str:
        return json.dumps(row, sort_keys=True, default=str)

    free: dict[str, list[int]] = collections.defaultdict(list)
    for i, row in enumerate(rows):
        free[key(row)].append(i)
    index: dict[int, int] = {}  # group id -> prompt index (a group's members share a prompt)
    out = []
    for traj in trajectories:
        if traj.group_id not in index:
            unclaimed = free[key(traj.sample)]
            index[traj.group_id] = unclaimed.pop(0) if unclaimed else -1
        out.append(trajectory_record(traj, index[traj.group_id]))
    return out


@ray.remote
class RolloutWorker:
    """Owns the router over the engines and the RolloutManagers (training and evaluation).

    Args:
        cfg_yaml: the resolved run config as YAML.
        engine_urls: one URL per engine; engine_ids: their names (``engine0``, ...).
    """

    def __init__(self, cfg_yaml: str, engine_urls: list[str], engine_ids: list[str]) -> None:
        from omegaconf import OmegaConf
        from transformers import AutoTokenizer

        from megarl.launch.route_workers import routed_clients
        from megarl.plugins import import_plugins
        from megarl.rollout.client import SGLangClient
        from megarl.rollout.manager import RolloutManager
        from megarl.rollout.router import Router

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = as_megarl_config(OmegaConf.create(cfg_yaml))
        import_plugins(cfg.plugins)  # the tools, reward and agent loop they register
        self.cfg = cfg
        tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
        timeout = float(cfg.rollout.engine.request_timeout_s)
        # SGLangClients, or (R3) RoutedClients: SGLangClients by delegation (megarl.launch.route_workers)
        clients: list[Any] = [SGLangClient(url, engine_id=eid, request_timeout_s=timeout)
                   for url, eid in zip(engine_urls, engine_ids)]
        if cfg.train.routing_replay == "r3":  # routes decoded and kept by one worker per engine
            clients = routed_clients(clients, timeout)
        self.router = Router(clients)
        self.seeded = SeededEngine(self.router, cfg.train.seed) if cfg.rollout.deterministic_sampling else None
        engine = self.seeded or self.router
        # Without over-sampling there is nothing to replace a filtered group with: the manager then
        # returns every group, so the step's reward statistics cover all trajectories, and the
        # driver's filter (megarl.launch.advantage_stage) drops the zero-variance groups and counts them.
        dynamic = cfg.algorithm.filter_zero_variance_groups and cfg.rollout.over_sample_prompts > 0
        # R3: training rollouts ask every turn for the engine's routed experts (evaluation does not train).
        self.manager = RolloutManager(engine, tokenizer, cfg.rollout, prompt_key=cfg.data.prompt_key,
                                      filter_zero_variance=dynamic,
                                      return_routed_experts=cfg.train.routing_replay == "r3")
        shared: dict[str, Any] = dict(prompt_key=cfg.data.prompt_key, filter_zero_variance=False,
                                      tools=self.manager.ctx.tools, reward_fn=self.manager.reward_fn)
        self.eval_manager = RolloutManager(self.router, tokenizer, _eval_rollout_config(cfg.rollout), **shared)
        samples = int(cfg.data.eval_samples_per_prompt or 0)
        # Every evaluation draws the same seeds per prompt (common random numbers), so before/after
        # differences are not blurred by different draws, and the seeds are a function of the eval
        # config alone (train.seed, the prompt): `megarl eval --checkpoint` and `--hf` of the same
        # weights sample alike, deterministic_sampling or not.
        self.eval_seeded = SeededEngine(self.router, cfg.train.seed)
        self.sampled_eval_manager = RolloutManager(
            self.eval_seeded, tokenizer, _eval_rollout_config(cfg.rollout, samples),
            **shared) if samples > 0 else None

    async def generate(self, rows: list[dict], step: int, policy_version: int) -> Any:
        """One step's rollouts: a :class:`~megarl.rollout.manager.RolloutBatch` (groups, metrics).

        Several steps' rollouts may run at once (async mode keeps up to ``rollout.max_staleness``
        in flight): each call runs on its own fork of the manager, with its own seeded engine when
        sampling is deterministic (seeds depend on the step, not on what else is running).

        Args:
            rows: the step's prompts; step: the RL step they are for; policy_version: the engines'
                weight version when the rollout starts (stamped where an engine reports none).
        """
        engine = None
        if self.seeded is not None:
            engine = SeededEngine(self.router, self.seeded.seed)
            engine.start_step(step)
        # Async mode runs several steps' rollouts at once: none may abort the engines' requests wholesale.
        manager = self.manager.fork(engine, exclusive=not self.cfg.rollout.async_mode)
        manager.policy_version = policy_version
        batch = await manager.generate_groups(rows)
        batch.metrics.update(self.router.metrics())
        if self.cfg.train.routing_replay == "r3":
            put_routes(batch.groups)
        first = min(batch.groups, key=lambda g: g.group_id, default=None)
        batch.sample_text = self.describe(first.trajectories[0]) if first else ""  # for the log
        return batch

    async def evaluate(self, rows: list[dict], policy_version: int) -> tuple[dict[str, float], str]:
        """Held-out evaluation and the decoded first greedy trajectory (for the log).

        Greedy, one trajectory per prompt: ``eval/accuracy`` (reward >= 1), ``eval/reward_mean``,
        ``eval/tool_calls_mean``, ``eval/num_samples`` (prompts). With
        ``data.eval_samples_per_prompt = k > 0`` also ``eval/sampled_reward_mean`` and
        ``eval/sampled_accuracy`` over ``k`` trajectories per prompt sampled with the training
        settings (mean@k). Trajectories that failed count as wrong (reward 0).
        """
        metrics, sample, _ = await self.evaluate_records(rows, policy_version)
        return metrics, sample

    async def evaluate_records(self, rows: list[dict], policy_version: int
                               ) -> tuple[dict[str, float], str, dict[str, list[dict]]]:
        """:meth:`evaluate` (the same generations, so the same metrics) and every trajectory as a
        record (:func:`megarl.rollout.trajectory_stats.trajectory_record`), ``{"greedy": [...], "sampled":
        [...]}`` in prompt order; a failed group has no records (``megarl eval``'s report)."""
        self.eval_manager.policy_version = policy_version
        metrics, trajs = await self._score(self.eval_manager, rows, 1)
        metrics = {f"eval/{k}": v for k, v in metrics.items()} | {"eval/num_samples": float(len(rows))}
        sampled_trajs: list = []
        if self.sampled_eval_manager is not None:
            self.eval_seeded.start_step(-1)  # the same seeds at every evaluation
            self.sampled_eval_manager.policy_version = policy_version
            sampled, sampled_trajs = await self._score(self.sampled_eval_manager, rows,
                                                       int(self.cfg.data.eval_samples_per_prompt))
            metrics |= {"eval/sampled_reward_mean": sampled["reward_mean"],
                        "eval/sampled_accuracy": sampled["accuracy"]}
        records = {"greedy": _records(trajs, rows), "sampled": _records(sampled_trajs, rows)}
        return metrics, self.describe(trajs[0]) if trajs else "", records

    @staticmethod
    async def _score(manager: Any, rows: list[dict], per_prompt: int) -> tuple[dict[str, float], list]:
        batch = await manager.generate_groups(rows, num_groups=len(rows))
        trajs = [t for g in sorted(batch.groups, key=lambda g: g.group_id) for t in g.trajectories]
        rewards = [t.reward for t in trajs] + [0.0] * (len(rows) * per_prompt - len(trajs))
        return {"accuracy": float(np.mean([r >= 1.0 - 1e-6 for r in rewards])), "reward_mean": float(np.mean(rewards)),
                "tool_calls_mean": float(np.mean([t.metadata.get("tool_calls", 0) for t in trajs] or [0.0]))}, trajs

    def describe(self, trajectory: Any) -> str:
        """One trajectory as text (prompt tail, every turn and observation) for the log."""
        text = self.tokenizer.decode(trajectory.response_ids.tolist(), skip_special_tokens=False)
        question = str(trajectory.sample.get(self.cfg.data.prompt_key, ""))[:200]
        return (f"[reward {trajectory.reward:g}, {trajectory.num_turns} turns, {trajectory.status.value}] "
                f"{question!r} -> {text[:600]!r}")

    async def pause(self, mode: str = "retract") -> None:
        """Pause generation on every live engine."""
        await self.router.pause(mode)

    async def resume(self) -> None:
        """Continue generation on every live engine."""
        await self.router.resume()

    async def flush_cache(self) -> None:
        """Flush every live engine's prefix cache."""
        await self.router.flush_cache()

    async def engine_health(self) -> dict[str, bool]:
        """``{engine_id: healthy}``; an engine that does not answer is taken out of service."""
        out = {}
        for client in self.router.clients:
            out[client.engine_id] = await client.health()
            if not out[client.engine_id]:
                self.router.mark_dead(client.engine_id, "health check failed")
        return out

    def out_of_service(self) -> list[str]:
        """Ids of the engines the router sends nothing to (found dead, or not yet admitted)."""
        return [s.client.engine_id for s in self.router.slots if not s.alive]

    async def set_alive(self, engine_id: str, weight_version: str) -> bool:
        """Put a restarted, re-synced engine back into service once it reports ``weight_version``
        (see :meth:`megarl.rollout.router.Router.admit`); returns whether it was admitted."""
        return await self.router.admit(engine_id, weight_version)

    async def weight_versions(self) -> dict[str, str | None]:
        """``{engine_id: weight_version}`` of the live engines."""
        return {c.engine_id: await c.get_weight_version() for c in self.router.alive_clients()}

    async def close(self) -> None:
        """Close the HTTP sessions and the reward's worker processes."""
        await self.manager.close()
        await self.router.close()
