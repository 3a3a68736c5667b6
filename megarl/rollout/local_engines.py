"""Start a run's engines on this node: ``rollout.num_engines`` SGLang servers
(:class:`~megarl.rollout.engine_process.EngineProcess`), launched together and waited for in parallel."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from megarl.procs.ports import find_free_port
from megarl.rollout.engine_process import EngineProcess
from megarl.rollout.engine_resources import local_host


def launch_engines(cfg, model_path: str | os.PathLike, *, device: str = "auto",
                   log_dir: str | os.PathLike | None = None, wait: bool = True,
                   enable_return_routed_experts: bool = False,
                   custom_weight_loaders: Sequence[str] = (),
                   extra_env: Mapping[str, str] | None = None) -> list[EngineProcess]:
    """Start ``cfg.num_engines`` SGLang servers on this node, in parallel.

    Args:
        cfg: the ``rollout`` section (:class:`megarl.config.schema.RolloutConfig`).
        model_path: model directory to serve.
        device: ``auto``, ``cuda`` or ``cpu`` (``cluster.device``).
        log_dir: directory for ``engine{i}.log``; default: temporary files.
        wait: block until every engine answers ``/health`` (``cfg.engine.startup_timeout_s``).
        enable_return_routed_experts: capture routed experts (``train.routing_replay == "r3"``).
        custom_weight_loaders: ``--custom-weight-loader`` import paths (the weight-sync transport's).
        extra_env: extra environment variables for every server.

    Returns:
        The engines, started (and healthy if ``wait``). With ``cfg.external_engine_urls`` set,
        nothing is launched and the list is empty: use the URLs directly.

    Raises:
        megarl.rollout.engine_process.EngineStartupError: an engine failed to start; all engines started here
            are stopped.
    """
    if cfg.external_engine_urls:
        return []
    ecfg = cfg.engine
    engines: list[EngineProcess] = []
    try:
        for i in range(cfg.num_engines):
            port = find_free_port(local_host(ecfg.host), ecfg.base_port + 10 * i)
            log_path = Path(log_dir) / f"engine{i}.log" if log_dir else None
            engines.append(EngineProcess(
                model_path, port=port, host=ecfg.host, tp_size=ecfg.tensor_parallel_size,
                ep_size=int(ecfg.expert_parallel_size),
                device=device, dtype=ecfg.dtype, mem_fraction_static=ecfg.mem_fraction_static,
                max_total_tokens=ecfg.max_total_tokens, grammar_backend=ecfg.grammar_backend,
                enable_return_routed_experts=enable_return_routed_experts,
                custom_weight_loaders=custom_weight_loaders, extra_args=list(ecfg.extra_args),
                env=extra_env, log_path=log_path, engine_id=f"engine{i}").start())
        if wait:
            _wait_all_healthy(engines, ecfg.startup_timeout_s)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def _wait_all_healthy(engines: Sequence[EngineProcess], timeout_s: float) -> None:
    """Wait for every engine side by side; the first engine's error (in order) once all are done."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(engines))) as pool:  # leaving the block waits for every engine
        for future in [pool.submit(engine.wait_healthy, timeout_s) for engine in engines]:
            future.result()
