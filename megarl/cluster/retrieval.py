"""The run's retrieval service (``retrieval`` section), started next to the engines.

The service is one process for the whole run, so every rollout worker's ``search`` tool shares one
index. It is launched by a small Ray actor (:class:`RetrievalActor`) that owns the process on its
node: in a Slurm job (nodes advertise ``megarl_node_<i>``) that is the first rollout node, otherwise
wherever Ray places it (the driver's node). With ``retrieval.url`` nothing is started. The service's
URL is written into ``rollout.tools.search.url`` when the YAML leaves it empty.

Start-up refusals (an index built from another corpus than ``retrieval.corpus``, another backend
than ``retrieval.backend``) fail the run before any rollout, with the service's message.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf, open_dict

logger = logging.getLogger(__name__)

BACKENDS = ("bm25", "dense")


class RetrievalConfigError(ValueError):
    """The ``retrieval`` section or the search tool's settings are inconsistent (names the key)."""


@ray.remote(num_cpus=0)
class RetrievalActor:
    """Owns one :class:`~megarl.retrieval.service.RetrievalProcess` on its node."""

    def __init__(self, settings: dict[str, Any], log_path: str) -> None:
        from megarl.retrieval.service import RetrievalProcess

        host = settings["host"]
        if host == "node":  # the address of the node Ray placed this actor on
            host = ray.util.get_node_ip_address()
        self.process = RetrievalProcess(settings["index"], backend=settings["backend"],
                                        corpus=settings.get("corpus"), host=host,
                                        port=settings.get("port"),
                                        max_batch_queries=int(settings["max_batch_queries"]),
                                        max_wait_ms=float(settings["max_wait_ms"]), log_path=log_path)

    def start(self, timeout_s: float) -> str:
        """Start and wait for ``/health``; the URL. Raises RetrievalStartupError."""
        self.process.start().wait_ready(timeout_s)
        return self.process.url

    def stop(self) -> None:
        """Stop the retrieval server process (SIGTERM, then SIGKILL of its process group)."""
        self.process.stop()


def _placement_options(cfg: Any) -> dict[str, Any]:
    """Pin the actor to the first rollout node when nodes advertise ``megarl_node_<i>`` (Slurm)."""
    resources = ray.cluster_resources()
    cluster = cfg.cluster
    colocated = cluster.placement == "colocated"
    node = 0 if colocated else int(cluster.trainer_nodes)
    key = f"megarl_node_{node}"
    return {"resources": {key: 0.001}} if key in resources else {}


def uses_search(cfg: Any) -> bool:
    """True when the run gives the policy the ``search`` tool (``rollout.tools`` names it), so a
    retrieval service must run beside the engines.
    """
    return "search" in (cfg.rollout.tools or {})


def check_retrieval(cfg: Any) -> None:
    """Consistency of ``retrieval`` with ``rollout.tools.search``.

    Raises:
        RetrievalConfigError: unknown backend, or a search tool with nowhere to send queries.
    """
    r = cfg.retrieval
    if r.backend not in BACKENDS:
        raise RetrievalConfigError(f"retrieval.backend must be one of {BACKENDS}, got {r.backend!r}")
    if uses_search(cfg) and not (r.index or r.url or (cfg.rollout.tools.search or {}).get("url")):
        raise RetrievalConfigError("rollout.tools.search needs a service: set retrieval.index (megarl "
                                   "starts one), retrieval.url, or rollout.tools.search.url")


def start_retrieval(cfg: Any, log_dir: Any) -> Any:
    """Start the service when ``retrieval.index`` is set; fill in the search tool's URL.

    Returns:
        The :class:`RetrievalActor` handle (stop it at the end), or None when none was started.

    Raises:
        RetrievalConfigError: see :func:`check_retrieval`.
        RetrievalStartupError: the service refused the index or did not come up.
    """
    check_retrieval(cfg)
    r = cfg.retrieval
    actor, url = None, r.url
    if url is None and r.index:
        settings: Any = OmegaConf.to_container(r, resolve=True)
        for key in ("index", "corpus"):  # the actor's working directory may not be the driver's
            if settings.get(key):
                settings[key] = str(Path(settings[key]).resolve())
        options = _placement_options(cfg)
        if settings["host"] == "auto":  # loopback on one host; the node's address when pinned to one
            settings["host"] = "node" if options else "127.0.0.1"
        actor = RetrievalActor.options(**options).remote(  # type: ignore[attr-defined]  # a Ray actor class
            settings, str(log_dir / "retrieval.log"))
        try:
            url = ray.get(actor.start.remote(float(r.startup_timeout_s)))
        except ray.exceptions.RayTaskError as e:
            ray.kill(actor, no_restart=True)
            raise e.as_instanceof_cause() from None
        logger.info("retrieval service (%s, %s) at %s", r.backend, r.index, url)
    if url and uses_search(cfg) and not (cfg.rollout.tools.search or {}).get("url"):
        with open_dict(cfg):
            if cfg.rollout.tools.search is None:
                cfg.rollout.tools.search = {}
            cfg.rollout.tools.search.url = url
    return actor


def stop_retrieval(actor: Any) -> None:
    """Stop the service (best effort)."""
    if actor is None:
        return
    try:
        ray.get(actor.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - teardown
        pass
    ray.kill(actor, no_restart=True)
