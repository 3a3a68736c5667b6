"""Ray start-up and placement of trainer ranks and rollout engines (the ``cluster`` section).

Placement (docs/architecture.md):

- ``disaggregated`` (default): two placement groups. The trainer group has one bundle per trainer
  rank (``trainer_nodes x trainer_devices_per_node``; ``{"CPU": 1, "GPU": 1}`` on CUDA); the rollout
  group has one bundle per engine holding all of that engine's devices (``{"CPU": 1, "GPU": tp*ep}``),
  so the engine's SGLang server sees exactly its GPUs. Trainer and engines never share a device.
  An engine larger than a node (``tp > cluster.rollout_devices_per_node``, a whole multiple of it:
  :func:`megarl.cluster.bundles.engine_nodes`) has one bundle per node part instead (``{"CPU": 1, "GPU": per_node}``);
  its parts take the bundles of consecutive nodes (:func:`engine_part_bundles`), and each part's
  actor starts that node's SGLang process (``--nnodes``/``--node-rank``; node-rank 0 serves HTTP).
- ``colocated``: one placement group (the trainer's); engine ``i`` sits in the bundle of trainer
  rank ``i * devices_per_engine`` with a fractional GPU share, and its SGLang server is given the GPUs
  of trainer ranks ``i * devices_per_engine ... (i + 1) * devices_per_engine - 1``
  (``CUDA_VISIBLE_DEVICES``; Ray gives an actor GPUs of one bundle only). The engines run with
  ``--enable-memory-saver`` and the driver releases their memory around every train step
  (:mod:`megarl.cluster.colocated`).

Rank order: Ray's ``PACK`` strategy does not order bundles by node, so trainer rank ``r`` takes the
``r``-th bundle after sorting them by node and GPU id (:func:`bundle_order`): consecutive ranks (a
tensor-parallel group, a colocated engine's GPUs) then share a node, which is checked on CUDA.

On CPU the bundles hold only ``CPU`` and stand for processes; Ray local mode is started with at least
as many logical CPUs as the bundles need (they are a scheduling count, not a core reservation).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from megarl.cluster.bundles import BundleShapes
from megarl.config.parallel import trainer_world_size
from megarl.config.schema import MegarlConfig

logger = logging.getLogger(__name__)

COLOCATED_TRAINER_GPU = 0.5
"""GPU share a trainer rank requests when colocated (the engine in the same bundle gets the rest)."""
COLOCATED_ENGINE_GPU = 0.4


def engine_part_bundles(nodes: Sequence[str], num_engines: int, parts: int, *, cuda: bool) -> list[list[int]]:
    """Bundle of each node part of each engine: ``[engine][node_rank]``.

    Bundles are taken in node order (:func:`bundle_order`), ``parts`` at a time, so an engine's
    parts sit on consecutive nodes, node-rank 0 on the first.

    Args:
        nodes: node id of each bundle of the rollout placement group (``num_engines * parts``).
        cuda: on CUDA two parts of one engine on one node are refused (each part must own its node's
            GPUs); on CPU they may share a host.

    Raises:
        ValueError: on CUDA, an engine has two parts on one node (names the config key).
    """
    order = bundle_order(nodes, [None] * len(nodes))
    out = [order[e * parts:(e + 1) * parts] for e in range(num_engines)]
    for e, bundles in enumerate(out):
        where = [nodes[b] for b in bundles]
        if cuda and len(set(where)) < len(where):
            raise ValueError(f"rollout.engine.tensor_parallel_size: engine {e} spans {parts} nodes but two of its "
                             f"parts "
                             f"landed on one node ({where}); a node must have exactly "
                             "cluster.rollout_devices_per_node GPUs for the rollout")
    return out


def worker_env(cuda: bool) -> dict[str, str]:
    """Environment every Ray worker of the run gets (thread counts, offline hub, no usage stats)."""
    env = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1")}
    if not cuda:
        # One intra-op thread per process: several ranks and engines share a few cores on CPU.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    elif "OMP_NUM_THREADS" in os.environ:
        # Ray would set 1 (an actor's CPU count); on CUDA the trainer group otherwise picks
        # the node's cores over its ranks (megarl.launch.trainer_group.omp_threads).
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    for key in ("MEGARL_GSM8K_DIR", "PYTHONPATH", "RAY_AUTH_MODE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


LOCAL_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray 2.x's switch (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``) that, when ``0``, makes
``ray._private.services.get_node_ip_address`` answer the loopback address instead of the machine's
interface address. Ray meant it for laptops; megarl sets it for the private single-host instance it
starts itself, so that GCS, raylet, workers and every rendezvous megarl takes from Ray's node address
(trainer group, weight sync, retrieval) bind and advertise 127.0.0.1 and nothing listens on the
machine's network. ``ray.init(_node_ip_address="127.0.0.1")`` does not do it: Ray rewrites a
loopback address to the interface address (``services.resolve_ip_for_localhost``)."""


@contextlib.contextmanager
def loopback_ray() -> Iterator[None]:
    """Make a Ray instance started inside the block live on 127.0.0.1 (see :data:`LOCAL_RAY_LOOPBACK_ENV`);
    wrap the ``ray.init`` that starts a local instance.

    Ray's own processes (GCS, raylet, and the workers the raylet starts) take the switch from the
    environment they are started in; this process keeps ``ENABLE_RAY_CLUSTER = False`` for its own
    address look-ups. The environment variable is restored when the block ends, so that nothing this
    process starts afterwards (a Slurm job, a multi-node ``ray start``) inherits it: a Ray worker
    node started with it refuses to join ("Multi-node Ray clusters are not supported").

    Raises:
        RuntimeError: the installed Ray no longer has the switch (the shim needs revisiting).
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError(f"ray {_ray_version()}: ray_constants.ENABLE_RAY_CLUSTER is gone; megarl's "
                           "loopback switch for a local Ray instance needs updating (megarl.cluster.placement)")
    previous = os.environ.get(LOCAL_RAY_LOOPBACK_ENV)
    os.environ[LOCAL_RAY_LOOPBACK_ENV] = "0"  # Ray's own processes, started from this environment
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process, whose ray_constants is already imported
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LOCAL_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[LOCAL_RAY_LOOPBACK_ENV] = previous


def _ray_version() -> str:
    import ray

    return ray.__version__


def init_ray(cfg: MegarlConfig, *, cuda: bool) -> bool:
    """Connect to ``cluster.ray_address`` or start a local Ray; reuse one already initialised.

    Args:
        cuda: the run uses CUDA (:attr:`megarl.cluster.bundles.BundleShapes.cuda`): the workers'
            environment (:func:`worker_env`).

    Returns:
        True when this call started (and so should shut down) Ray.
    """
    import ray

    if ray.is_initialized():
        logger.info("using the Ray instance already initialised in this process")
        return False
    env = worker_env(cuda)
    if cfg.cluster.ray_address:
        logger.info("connecting to the Ray cluster at %s", cfg.cluster.ray_address)
        ray.init(address=cfg.cluster.ray_address, runtime_env=_runtime_env(env), log_to_driver=True)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance
    # Ray's memory monitor kills the most recent worker when the *machine* is nearly full, whoever
    # uses the memory; on a shared workstation that would take down an engine or trainer rank.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    needed = trainer_world_size(cfg.cluster) + int(cfg.rollout.num_engines) + 2
    num_cpus = max(os.cpu_count() or 1, needed)
    logger.info("starting a local Ray instance (%d logical CPUs) on 127.0.0.1", num_cpus)
    with loopback_ray():
        # address="local": a new instance even where RAY_ADDRESS or the last `ray start` on this machine
        # (/tmp/ray/ray_current_cluster: another user's, or a Slurm job's on a shared node) names a cluster,
        # which Ray 2.60's ray.init() would join otherwise (services.canonicalize_bootstrap_address)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=_runtime_env(env),
                 log_to_driver=True, logging_level=logging.WARNING)
    return True


def _runtime_env(env: dict[str, str]) -> dict[str, Any]:
    """The job's runtime env: ``env`` in every worker, and megarl's filter of known third-party
    console noise installed in each worker at start (:mod:`megarl.logging_setup`)."""
    from megarl.logging_setup import RAY_SETUP_HOOK

    return {"env_vars": env, "worker_process_setup_hook": RAY_SETUP_HOOK}


@dataclasses.dataclass
class Placement:
    """Where each trainer rank and each engine goes.

    Attributes:
        trainer_pg: placement group of the trainer ranks.
        rollout_pg: placement group of the engines (bundle ``i`` = engine ``i``); the trainer's
            group when colocated.
        engine_bundles: bundle index of each engine inside ``rollout_pg``.
        trainer_num_gpus, engine_num_gpus: GPU share each actor requests in its bundle (0 on CPU).
        colocated: trainer and engines share devices (and bundles: each then asks half a CPU).
        trainer_bundles: bundle index of each trainer rank (:func:`bundle_order`); None = rank order.
        engine_devices: colocated on CUDA: the GPU ids each engine's server sees; else empty.
        engine_parts: bundle of each node part ``[engine][node_rank]`` (one part per engine unless
            engines span nodes: :func:`megarl.cluster.bundles.engine_nodes`); ``engine_bundles`` holds
            the first parts'.
        cuda: the run uses CUDA (:attr:`megarl.cluster.bundles.BundleShapes.cuda`).
        engine_nodes: nodes one engine spans (:attr:`megarl.cluster.bundles.BundleShapes.engine_nodes`).
    """

    trainer_pg: Any
    rollout_pg: Any
    engine_bundles: list[int]
    trainer_num_gpus: float
    engine_num_gpus: float
    colocated: bool
    trainer_bundles: list[int] | None = None
    engine_devices: list[list[str]] = dataclasses.field(default_factory=list)
    engine_parts: list[list[int]] = dataclasses.field(default_factory=list)
    cuda: bool = False
    engine_nodes: int = 1

    @property
    def _num_cpus(self) -> float:
        return 0.5 if self.colocated else 1.0

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """``.options(**...)`` for the actor of trainer rank ``rank``."""
        bundle = rank if self.trainer_bundles is None else self.trainer_bundles[rank]
        return _pg_options(self.trainer_pg, bundle, self._num_cpus, self.trainer_num_gpus)

    def engine_options(self, engine_index: int, node_rank: int = 0) -> dict[str, Any]:
        """``.options(**...)`` for the actor that owns engine ``engine_index`` (its node part
        ``node_rank`` when it spans nodes)."""
        bundle = (self.engine_parts[engine_index][node_rank] if self.engine_parts
                  else self.engine_bundles[engine_index])
        return _pg_options(self.rollout_pg, bundle, self._num_cpus, self.engine_num_gpus)

    def engine_env(self, engine_index: int) -> dict[str, str]:
        """Environment of engine ``engine_index``'s server: colocated on CUDA, the GPUs of its
        trainer ranks (Ray set the actor's own ``CUDA_VISIBLE_DEVICES`` to one of them only)."""
        if not self.engine_devices:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.engine_devices[engine_index])}

    def remove(self) -> None:
        """Release the placement groups."""
        from ray.util.placement_group import remove_placement_group

        for pg in {id(self.trainer_pg): self.trainer_pg, id(self.rollout_pg): self.rollout_pg}.values():
            if pg is not None:  # evaluation with external engines reserves nothing
                remove_placement_group(pg)


def _pg_options(pg: Any, bundle: int, num_cpus: float, num_gpus: float) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": num_cpus, "num_gpus": num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True)}


def bundle_order(nodes: Sequence[str], gpus: Sequence[str | int | None]) -> list[int]:
    """Bundle indices in rank order: grouped by node, GPU id ascending within a node.

    Nodes keep the order of their first bundle (rank 0's node is bundle 0's). Ray's ``PACK``
    strategy may interleave nodes (bundle 0 on node A, 1 on B, 2 on A, ...); without this order a
    tensor-parallel group of consecutive ranks could straddle two nodes.

    Args:
        nodes: node id of each bundle.
        gpus: GPU id of each bundle (None on CPU).
    """
    first: dict[str, int] = {}
    for node in nodes:
        first.setdefault(node, len(first))
    return sorted(range(len(nodes)), key=lambda b: (first[nodes[b]], -1 if gpus[b] is None else int(gpus[b]), b))  # type: ignore[arg-type]


def check_groups_on_one_node(rank_nodes: Sequence[str], group_size: int, what: str) -> None:
    """Raise unless every group of ``group_size`` consecutive ranks sits on one node.

    Raises:
        ValueError: names ``what`` (the config key sizing the group), the group and its nodes.
    """
    for start in range(0, len(rank_nodes), group_size):
        nodes = list(dict.fromkeys(rank_nodes[start:start + group_size]))
        if len(nodes) > 1:
            raise ValueError(f"{what}={group_size}: ranks {start}..{start + group_size - 1} span nodes {nodes}; "
                             f"make the devices per node a multiple of {group_size}")


def _bundle_locations(pg: Any, num_bundles: int, cuda: bool) -> tuple[list[str], list[str | None]]:
    """(node id, GPU id) of each bundle of a ready placement group (a tiny probe task per bundle on CUDA)."""
    import ray
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    nodes = [table[b] for b in range(num_bundles)]
    if not cuda:
        return nodes, [None] * num_bundles
    probe = ray.remote(_gpu_ids)
    refs = [probe.options(**_pg_options(pg, b, 0, 0.01)).remote() for b in range(num_bundles)]
    return nodes, [ids[0] for ids in ray.get(refs, timeout=120)]


def _gpu_ids() -> list[str]:
    import ray

    return [str(g) for g in ray.get_gpu_ids()]


def with_roles(shapes: BundleShapes, roles: bool) -> tuple[list[dict], list[dict]]:
    """The trainer and rollout bundles of ``shapes``; with ``roles`` (the cluster advertises
    ``megarl_trainer`` / ``megarl_rollout`` per node: Slurm jobs), each also asks for its role's
    resource (``megarl_trainer``: 1, ``megarl_rollout``: the devices of one engine node part), which
    pins trainer ranks and engines to their nodes."""
    if not roles:
        return shapes.trainer, shapes.rollout
    per_part = shapes.devices_per_engine // shapes.engine_nodes
    return ([{**b, "megarl_trainer": 1} for b in shapes.trainer],
            [{**b, "megarl_rollout": per_part} for b in shapes.rollout])


def build_placement(cfg: MegarlConfig, shapes: BundleShapes, *, timeout_s: float = 300.0) -> Placement:
    """Create the placement groups of ``shapes`` (:func:`megarl.cluster.bundles.bundle_shapes`; an
    evaluation's with ``engines_only``) and wait until they are ready.

    Raises:
        TimeoutError: the cluster does not have the resources (the message lists what was asked).
        ValueError: on CUDA, a tensor-parallel group or an engine's node parts would share or span
            nodes (:func:`check_groups_on_one_node`, :func:`engine_part_bundles`).
    """
    import ray
    from ray.util.placement_group import placement_group

    cuda, per_engine, parts = shapes.cuda, shapes.devices_per_engine, shapes.engine_nodes
    trainer, rollout = with_roles(shapes, "megarl_trainer" in ray.cluster_resources())
    trainer_pg = placement_group(trainer, strategy="PACK", name="megarl_trainer") if trainer else None
    if shapes.colocated:
        bundles = [min(i * per_engine, len(trainer) - 1) for i in range(shapes.num_engines)]
        placement = Placement(trainer_pg, trainer_pg, bundles, COLOCATED_TRAINER_GPU if cuda else 0,
                              COLOCATED_ENGINE_GPU if cuda else 0, True, cuda=cuda, engine_nodes=parts)
    else:
        rollout_pg = placement_group(rollout, strategy="PACK", name="megarl_rollout") if rollout else trainer_pg
        placement = Placement(trainer_pg if trainer_pg is not None else rollout_pg, rollout_pg,
                              list(range(len(rollout) // parts)), 1 if cuda else 0,
                              per_engine // parts if cuda else 0, False, cuda=cuda, engine_nodes=parts)
    groups = list({id(pg): pg for pg in (trainer_pg, placement.rollout_pg) if pg is not None}.values())
    try:
        ray.get([pg.ready() for pg in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(
            f"placement groups not ready after {timeout_s:.0f}s: trainer {trainer[:1]} x "
            f"{len(trainer)}, engines {rollout[:1]} x {len(rollout)} "
            f"({cfg.cluster.placement}); cluster has {ray.cluster_resources()}") from e
    if trainer_pg is not None:
        _order_trainer_bundles(placement, cfg, cuda=cuda, world=len(trainer), per_engine=per_engine,
                               check_tp=not shapes.engines_only)
    if not placement.colocated and rollout and parts > 1:
        nodes, _ = _bundle_locations(placement.rollout_pg, len(rollout), False)
        placement.engine_parts = engine_part_bundles(nodes, len(rollout) // parts, parts, cuda=cuda)
        placement.engine_bundles = [p[0] for p in placement.engine_parts]
    return placement


def _order_trainer_bundles(placement: Placement, cfg: MegarlConfig, *, cuda: bool, world: int, per_engine: int,
                           check_tp: bool = True) -> None:
    """Rank -> bundle by node and GPU; colocated engines' bundles and GPUs follow (module docstring).

    Raises:
        ValueError: on CUDA, a tensor-parallel group or a colocated engine would span two nodes.
    """
    nodes, gpus = _bundle_locations(placement.trainer_pg, world, cuda)
    order = bundle_order(nodes, gpus)
    placement.trainer_bundles = order
    rank_nodes = [nodes[b] for b in order]
    if cuda and check_tp:
        check_groups_on_one_node(rank_nodes, int(cfg.parallel.tensor_model_parallel_size),
                                 "parallel.tensor_model_parallel_size")
    if placement.colocated:
        num_engines = len(placement.engine_bundles)
        placement.engine_bundles = [order[min(i * per_engine, world - 1)] for i in range(num_engines)]
        if cuda:
            check_groups_on_one_node(rank_nodes[:num_engines * per_engine], per_engine,
                                     "rollout.engine.tensor_parallel_size (colocated engine GPUs)")
            placement.engine_devices = [[str(gpus[b]) for b in order[i * per_engine:(i + 1) * per_engine]]
                                        for i in range(num_engines)]
