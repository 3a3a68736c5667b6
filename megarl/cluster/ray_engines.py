"""Rollout engines as Ray actors, placed by the ``cluster`` section.

Each engine is one :class:`megarl.rollout.engine_actor.EngineActor` (the engine owner's launcher)
in its placement bundle; the actor starts an SGLang server on its node and reports the URL. Traffic
goes to that URL over HTTP (the rollout actor's router), never through Ray. With
``rollout.external_engine_urls`` no engine is launched and the URLs are used as they are.

An engine larger than a node (:func:`megarl.cluster.bundles.engine_nodes`) is one actor per node
part, each in its own bundle (consecutive nodes), each starting its node's SGLang process with
``--nnodes N --node-rank r --dist-init-addr HEAD:PORT`` (HEAD: node-rank 0's address and a free port
there). Only node-rank 0 serves HTTP, so the engine's URL is its first part's; the parts are one
engine for everything else: a part that stops answering takes the whole engine down
(:meth:`EngineGroup.stop_broken`), and restart and shutdown act on every part.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from megarl.config.schema import MegarlConfig

logger = logging.getLogger(__name__)

DETERMINISTIC_FLAG = "--enable-deterministic-inference"
MEMORY_SAVER_FLAG = "--enable-memory-saver"
"""Colocated on CUDA: lets ``/release_memory_occupation`` free the engine's GPU memory for training."""
"""SGLang honours a request's ``sampling_seed`` only with this server flag (GPU attention backends)."""
SEEDING_SHIM_DIR = Path(__file__).resolve().parent / "sglang_seeding"
"""CPU: a ``sitecustomize`` that makes the server honour ``sampling_seed`` (the flag above refuses
the CPU attention backend); see ``sglang_seeding/sitecustomize.py``."""


def seeding_env(cfg: MegarlConfig, device: str) -> dict[str, str]:
    """Environment of an engine actor for ``rollout.deterministic_sampling`` on CPU (else empty)."""
    if not cfg.rollout.deterministic_sampling or device != "cpu":
        return {}
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(SEEDING_SHIM_DIR)]
    return {"PYTHONPATH": os.pathsep.join(parts), "MEGARL_SEEDED_SAMPLING": "1"}


def engine_kwargs(cfg: MegarlConfig, *, device: str, log_path: str | None, engine_id: str,
                  custom_weight_loaders: Sequence[str] = (), env: Mapping[str, str] | None = None) -> dict:
    """:class:`~megarl.rollout.engine_process.EngineProcess` keyword arguments from the run config."""
    ecfg = cfg.rollout.engine
    extra = list(ecfg.extra_args)
    if cfg.rollout.deterministic_sampling and device != "cpu" and DETERMINISTIC_FLAG not in extra:
        extra.append(DETERMINISTIC_FLAG)
    if cfg.cluster.placement == "colocated" and device != "cpu" and MEMORY_SAVER_FLAG not in extra:
        extra.append(MEMORY_SAVER_FLAG)
    return dict(host=ecfg.host, tp_size=int(ecfg.tensor_parallel_size),
                ep_size=int(ecfg.expert_parallel_size), device=device, dtype=ecfg.dtype,
                mem_fraction_static=ecfg.mem_fraction_static, max_total_tokens=ecfg.max_total_tokens,
                grammar_backend=ecfg.grammar_backend, sleep_on_idle=bool(ecfg.sleep_on_idle),
                enable_return_routed_experts=cfg.train.routing_replay == "r3",
                custom_weight_loaders=list(custom_weight_loaders), extra_args=extra,
                env=dict(env or {}), log_path=log_path, engine_id=engine_id)


class EngineGroup:
    """The run's SGLang engines (launched as Ray actors, or external URLs).

    Args:
        cfg: the resolved run config.
        placement: :class:`megarl.cluster.placement.Placement` (also: CUDA or not, the nodes an engine spans).
        model_path: the HF directory the engines load at start.
        log_dir: ``engine{i}.log`` files go here.
        custom_weight_loaders, env: passed to every server (the weight-sync transport's needs).
    """

    def __init__(self, cfg: MegarlConfig, placement: Any, model_path: str, log_dir: Path, *,
                 custom_weight_loaders: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        from megarl.rollout.engine_actor import EngineActor

        self.startup_timeout_s = float(cfg.rollout.engine.startup_timeout_s)
        self.external = list(cfg.rollout.external_engine_urls)
        self.actors: list[Any] = []
        """Each engine's first (HTTP-serving) actor."""
        self.parts: list[list[Any]] = []
        """Each engine's actors by node rank (one unless the engine spans nodes)."""
        self._start_refs: list[list[Any]] = []
        if self.external:
            self.ids = [f"engine{i}" for i in range(len(self.external))]
            return
        device = "cuda" if placement.cuda else "cpu"
        remote_cls = ray.remote(EngineActor)
        self.ids = [f"engine{i}" for i in range(int(cfg.rollout.num_engines))]
        nnodes = placement.engine_nodes
        for i, engine_id in enumerate(self.ids):
            parts = []
            for rank in range(nnodes):
                name = engine_id if rank == 0 else f"{engine_id}.node{rank}"
                kwargs = engine_kwargs(cfg, device=device, log_path=str(log_dir / f"{name}.log"),
                                       engine_id=name, custom_weight_loaders=custom_weight_loaders,
                                       env={**(env or {}), **placement.engine_env(i)})  # colocated: its GPUs
                if nnodes > 1:
                    kwargs.update(nnodes=nnodes, node_rank=rank)
                # One thread: the server's parent-death signal is tied to the thread that started it.
                options = dict(placement.engine_options(i, rank))
                if seeding_env(cfg, device):
                    options["runtime_env"] = {"env_vars": seeding_env(cfg, device)}
                parts.append(remote_cls.options(**options).remote(
                    model_path, base_port=int(cfg.rollout.engine.base_port), engine_index=i, **kwargs))
            self.parts.append(parts)
            self.actors.append(parts[0])
            self._start_refs.append(self._start(parts))

    def wait_ready(self) -> list[str]:
        """Block until every launched engine is healthy; returns the URLs in engine order.

        Raises:
            megarl.rollout.engine_process.EngineStartupError: an engine did not start (with its log tail).
        """
        if self.external:
            return self.external
        started = ray.get([ref for refs in self._start_refs for ref in refs], timeout=self.startup_timeout_s + 60)
        urls, at = [], 0
        for refs in self._start_refs:  # the engine's URL is node-rank 0's
            urls.append(started[at])
            at += len(refs)
        for engine_id, url in zip(self.ids, urls):
            logger.info("%s ready at %s", engine_id, url)
        return urls

    def restart(self, index: int) -> str:
        """Restart engine ``index``, every node part of it (launch weights: the caller re-syncs it);
        returns its URL.

        Raises:
            RuntimeError: external engines cannot be restarted by megarl.
        """
        if self.external:
            raise RuntimeError(f"{self.ids[index]} is external ({self.external[index]}); restart it yourself")
        parts = self.parts[index]
        if len(parts) > 1:  # every part stops before any starts: the ranks rejoin one new rendezvous
            ray.get([p.kill.remote() for p in parts], timeout=60)
        refs = [p.restart.remote(timeout_s=self.startup_timeout_s) for p in parts]
        return ray.get(refs, timeout=self.startup_timeout_s + 60)[0]

    def kill(self, index: int, node_rank: int = 0) -> None:
        """SIGKILL engine ``index``'s server (its node part ``node_rank``; fault injection)."""
        ray.get(self.parts[index][node_rank].kill.remote(), timeout=60)

    def stop_broken(self) -> list[str]:
        """Take down every engine that spans nodes and has a part not answering ``/health``: its
        ranks on the other nodes cannot serve without it (its HTTP part would hang or fail on the
        next collective), so all its parts are stopped and the health check sees the engine down.

        Returns:
            The ids of the engines stopped (a warning each).
        """
        spanning = [i for i, parts in enumerate(self.parts) if len(parts) > 1]
        refs = {i: [p.health.remote() for p in self.parts[i][1:]] for i in spanning}
        broken = [i for i in spanning if not all(ray.get(refs[i], timeout=60))]
        for i in broken:
            logger.warning("%s: a node part stopped answering; stopping all %d parts", self.ids[i],
                           len(self.parts[i]))
            ray.get([p.kill.remote() for p in self.parts[i]], timeout=60)
        return [self.ids[i] for i in broken]

    def shutdown(self) -> None:
        """Stop every launched server and its actor (idempotent); node-rank 0 of each engine first
        (it stops the engine's ranks on the other nodes)."""
        for rank in range(max((len(p) for p in self.parts), default=0)):
            try:
                ray.get([parts[rank].stop.remote() for parts in self.parts if rank < len(parts)], timeout=60)
            except Exception as e:  # noqa: BLE001 - best effort at teardown
                logger.warning("stopping engines (node rank %d): %s", rank, e)
        for actor in (a for parts in self.parts for a in parts):
            ray.kill(actor, no_restart=True)
        self.actors, self.parts = [], []

    def _start(self, parts: list[Any]) -> list[Any]:
        """Start one engine's parts together (node-rank 0's rendezvous address to the others)."""
        if len(parts) == 1:
            return [parts[0].start.remote(timeout_s=self.startup_timeout_s)]
        addr = ray.get(parts[0].dist_init_addr.remote(), timeout=self.startup_timeout_s)
        return [p.start.remote(timeout_s=self.startup_timeout_s, dist_init_addr=addr) for p in parts]


def heal_engines(engines: EngineGroup, rollout_actor: Any, sync: Any, policy_version: int) -> list[str]:
    """Put every engine back into service: one the rollout actor's router took out of service
    although it still answers (a dropped connection while it was paused or busy) returns once it
    reports the synced policy version (weight syncs address every engine, in service or not); one that does not answer,
    or reports another version, is restarted, re-synced and then put back.

    Args:
        engines: the run's engines (an engine over several nodes with a part down is down as a whole:
            :meth:`EngineGroup.stop_broken`).
        rollout_actor: the :class:`megarl.launch.rollout_actor.RolloutWorker` handle (its router
            knows which engines are in service): its ``engine_health``, ``out_of_service`` and
            ``set_alive`` calls.
        sync: the weight sync (:class:`megarl.launch.weight_sync_stage.WeightSyncStage`): its
            ``synced_version`` (what a live engine must report) and ``resync(version)``, which
            reconnects to every engine (the old update groups included the dead ones) and pushes the
            trainer's weights.
        policy_version: the trainer's policy version (what a restarted engine is synced to).

    Returns:
        The ids of the engines put back (restarted or re-admitted; a warning each).

    Raises:
        RuntimeError: a restarted, re-synced engine does not report the synced version.
    """
    synced_version = sync.synced_version
    engines.stop_broken()
    health = ray.get(rollout_actor.engine_health.remote(), timeout=120)
    dead = [eid for eid, ok in health.items() if not ok]
    readmitted = []
    for eid in ray.get(rollout_actor.out_of_service.remote(), timeout=60):
        if eid in dead:
            continue
        if ray.get(rollout_actor.set_alive.remote(eid, str(synced_version)), timeout=60):
            logger.warning("%s was out of service but answers and reports policy version %d; back in "
                           "service", eid, synced_version)
            readmitted.append(eid)
        else:
            dead.append(eid)
    if not dead:
        return readmitted
    for eid in dead:
        logger.warning("%s stopped answering; its requests were re-routed to the live engines. "
                       "Restarting it", eid)
        engines.restart(engines.ids.index(eid))
    version = sync.resync(policy_version)
    for eid in dead:
        if not ray.get(rollout_actor.set_alive.remote(eid, str(version)), timeout=60):
            raise RuntimeError(f"{eid} was restarted and re-synced but does not report weight version "
                               f"{version}; it would serve other weights than the policy's")
        logger.warning("%s restarted and re-synced to policy version %d; back in service", eid, version)
    return readmitted + dead
