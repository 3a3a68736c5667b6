"""Rollout engines as Ray actors, placed by the ``cluster`` section.

Each engine is one :class:`megarl.rollout.engine_actor.EngineActor` (the engine owner's launcher)
in its placement bundle; the actor starts an SGLang server on its node and reports the URL. Traffic
goes to that URL over HTTP (the rollout actor's router), never through Ray. With
``rollout.external_engine_urls`` no engine is launched and the URLs are used as they are.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray

logger = logging.getLogger(__name__)

DETERMINISTIC_FLAG = "--enable-deterministic-inference"
MEMORY_SAVER_FLAG = "--enable-memory-saver"
"""Colocated on CUDA: lets ``/release_memory_occupation`` free the engine's GPU memory for training."""
"""SGLang honours a request's ``sampling_seed`` only with this server flag (GPU attention backends)."""
SEEDING_SHIM_DIR = Path(__file__).resolve().parent / "sglang_seeding"
"""CPU: a ``sitecustomize`` that makes the server honour ``sampling_seed`` (the flag above refuses
the CPU attention backend); see ``sglang_seeding/sitecustomize.py``."""


def seeding_env(cfg: Any, device: str) -> dict[str, str]:
    """Environment of an engine actor for ``rollout.deterministic_sampling`` on CPU (else empty)."""
    if not cfg.rollout.get("deterministic_sampling", False) or device != "cpu":
        return {}
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(SEEDING_SHIM_DIR)]
    return {"PYTHONPATH": os.pathsep.join(parts), "MEGARL_SEEDED_SAMPLING": "1"}


def engine_kwargs(cfg: Any, *, device: str, log_path: str | None, engine_id: str,
                  custom_weight_loaders: Sequence[str] = (), env: Mapping[str, str] | None = None) -> dict:
    """:class:`~megarl.rollout.engine.EngineProcess` keyword arguments from the run config."""
    ecfg = cfg.rollout.engine
    extra = list(ecfg.extra_args)
    if cfg.rollout.get("deterministic_sampling", False) and device != "cpu" and DETERMINISTIC_FLAG not in extra:
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
        placement: :class:`megarl.launch.cluster.Placement`.
        model_path: the HF directory the engines load at start.
        log_dir: ``engine{i}.log`` files go here.
        custom_weight_loaders, env: passed to every server (the weight-sync transport's needs).
    """

    def __init__(self, cfg: Any, placement: Any, model_path: str, log_dir: Path, *,
                 custom_weight_loaders: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        from megarl.launch.cluster import use_cuda
        from megarl.rollout.engine_actor import EngineActor

        self.startup_timeout_s = float(cfg.rollout.engine.startup_timeout_s)
        self.external = list(cfg.rollout.external_engine_urls)
        self.actors: list[Any] = []
        self._start_refs: list[Any] = []
        if self.external:
            self.ids = [f"engine{i}" for i in range(len(self.external))]
            return
        device = "cuda" if use_cuda(cfg.cluster.device) else "cpu"
        remote_cls = ray.remote(EngineActor)
        self.ids = [f"engine{i}" for i in range(int(cfg.rollout.num_engines))]
        for i, engine_id in enumerate(self.ids):
            kwargs = engine_kwargs(cfg, device=device, log_path=str(log_dir / f"{engine_id}.log"),
                                   engine_id=engine_id, custom_weight_loaders=custom_weight_loaders,
                                   env={**(env or {}), **placement.engine_env(i)})  # colocated: its GPUs
            # One thread: the server's parent-death signal is tied to the thread that started it.
            options = dict(placement.engine_options(i))
            if seeding_env(cfg, device):
                options["runtime_env"] = {"env_vars": seeding_env(cfg, device)}
            actor = remote_cls.options(**options).remote(model_path, base_port=int(cfg.rollout.engine.base_port),
                                                         engine_index=i, **kwargs)
            self.actors.append(actor)
            self._start_refs.append(actor.start.remote(timeout_s=self.startup_timeout_s))

    def wait_ready(self) -> list[str]:
        """Block until every launched engine is healthy; returns the URLs in engine order.

        Raises:
            megarl.rollout.engine.EngineStartupError: an engine did not start (with its log tail).
        """
        if self.external:
            return self.external
        urls = ray.get(self._start_refs, timeout=self.startup_timeout_s + 60)
        for engine_id, url in zip(self.ids, urls):
            logger.info("%s ready at %s", engine_id, url)
        return urls

    def restart(self, index: int) -> str:
        """Restart engine ``index`` (launch weights: the caller re-syncs it); returns its URL.

        Raises:
            RuntimeError: external engines cannot be restarted by megarl.
        """
        if self.external:
            raise RuntimeError(f"{self.ids[index]} is external ({self.external[index]}); restart it yourself")
        return ray.get(self.actors[index].restart.remote(timeout_s=self.startup_timeout_s),
                       timeout=self.startup_timeout_s + 60)

    def kill(self, index: int) -> None:
        """SIGKILL engine ``index``'s server (fault injection)."""
        ray.get(self.actors[index].kill.remote(), timeout=60)

    def shutdown(self) -> None:
        """Stop every launched server and its actor (idempotent)."""
        refs = [a.stop.remote() for a in self.actors]
        try:
            ray.get(refs, timeout=60)
        except Exception as e:  # noqa: BLE001 - best effort at teardown
            logger.warning("stopping engines: %s", e)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
