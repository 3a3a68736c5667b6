"""The trainer as a group of Ray actors, one per Megatron rank.

Each actor is one torch.distributed process: before the trainer is built it gets ``MASTER_ADDR``,
``MASTER_PORT`` (rank 0's node and a free port there), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
(its index among the ranks on its node) and ``OMP_NUM_THREADS`` (CUDA: the node's cores over its
ranks, :func:`omp_threads`, unless set by the user; Ray would leave 1). The CUDA device a rank uses
is the one Ray gave it (:func:`megarl.training.devices.local_device_index`), never
``LOCAL_RANK``. An RL step's data never passes through the group whole: `TrainerGroup.prepare`
puts one `megarl.training.shard.BatchShard` per data-parallel rank in the Ray object store (the
ranks of one data-parallel group read the same object), each rank resolves its own R3 route
references there, and every call returns metrics only (`TrainerGroup.train_step`). Other calls
fan out to all ranks with the same arguments. If one rank fails, the group kills every rank instead
of letting the others hang in a collective, and raises.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import ray
from omegaconf import OmegaConf

from megarl.cluster.placement import Placement
from megarl.config.device import use_cuda
from megarl.config.parallel import trainer_world_size
from megarl.config.schema import MegarlConfig, as_megarl_config
from megarl.procs.ports import find_free_port

logger = logging.getLogger(__name__)


class TrainerGroupError(RuntimeError):
    """A trainer rank failed or timed out; the whole group has been killed."""


@ray.remote
class TrainerWorker:
    """One trainer rank: holds a :class:`megarl.training.trainer.Trainer` and runs its methods."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        self.rank = rank
        self.trainer: Any = None
        self.syncer: Any = None

    def node_info(self, master_port: int | None = None) -> tuple[str, str, int, int]:
        """(node id, node IP, rendezvous port, CPU cores this process may run on).

        Args:
            master_port: None: no port (0 is returned); else ``cluster.master_port``: the port is the
                first free one at or above it on this node (0: anywhere below the ephemeral range),
                from :func:`megarl.procs.ports.find_free_port`, reserved there for this group.
        """
        port = 0 if master_port is None else _free_port(master_port)
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port,
                len(os.sched_getaffinity(0)))

    def device_info(self) -> dict[str, Any]:
        """What this rank sees: ``CUDA_VISIBLE_DEVICES``, Ray's GPU ids, and the device index it selects."""
        from megarl.training.devices import select_device_index

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:  # what CUDA will enumerate (also on a node with logical GPUs only)
            count = len([d for d in visible.split(",") if d.strip()])
        else:
            import torch

            count = torch.cuda.device_count()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return {"visible": visible, "gpu_ids": gpu_ids, "node": ray.get_runtime_context().get_node_id(),
                "device_index": select_device_index(visible_devices=visible, assigned_gpu_ids=gpu_ids,
                                                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                                    device_count=count) if count else None}

    def setup(self, master_addr: str, master_port: int, local_rank: int, cfg_yaml: str,
              num_threads: int | None = None) -> int:
        """Set the rendezvous variables and build the trainer (initialises torch.distributed).

        Args:
            num_threads: ``OMP_NUM_THREADS`` / torch intra-op threads of this rank (None: keep).

        Returns:
            The rank, once its trainer is built.
        """
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                           "LOCAL_RANK": str(local_rank)})
        if num_threads:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(num_threads)
            torch.set_num_threads(num_threads)
        from megarl.conversion.initial_weights import initial_weights
        from megarl.plugins import import_plugins
        from megarl.training.trainer_build import build_trainer

        cfg = as_megarl_config(OmegaConf.create(cfg_yaml))
        import_plugins(cfg.plugins)  # user modules, before anything is built
        # build_trainer initialises torch.distributed from RANK / WORLD_SIZE / MASTER_* (gloo on
        # CPU, nccl on CUDA), then Megatron's groups, the model (HF weights), DDP and optimizer.
        self.trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
        return self.rank

    def dp_rank(self) -> tuple[int, int, int]:
        """``(dp_rank, dp_size, cp_size)`` of this rank's trainer (`ParallelState`)."""
        p = self.trainer.parallel
        return p.dp_rank, p.dp_size, p.cp_size

    def prepare(self, shard: Any) -> dict[str, float]:
        """Resolve the R3 routes of this rank's shard (object-store references, or a checkpoint's
        route files: :func:`megarl.launch.route_files.resolve_routes`), then `Trainer.prepare` it
        (kept on the rank for `train_step`); returns its (reduced) metrics."""
        from megarl.launch.route_files import resolve_routes
        from megarl.training.shard import with_routes

        if shard.route_refs is not None:  # references, or files of a checkpoint's in-flight rollouts
            shard = with_routes(shard, resolve_routes(shard.route_refs))
        return self.trainer.prepare(shard)

    def train_step(self, mini: int) -> dict[str, float]:
        """One optimizer step on mini-batch ``mini`` of the prepared shard (`Trainer.train_prepared`)."""
        return self.trainer.train_prepared(mini)

    def save_checkpoint(self, directory: str) -> None:
        """Save this rank's part of a checkpoint (`Trainer.save_checkpoint`; every rank calls it)."""
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load this rank's part of a checkpoint (`Trainer.load_checkpoint`; every rank calls it)."""
        self.trainer.load_checkpoint(directory)

    def colocated_memory(self, fraction: float | None) -> dict[str, float]:
        """Colocated: offload what ``cluster.colocated_offload`` names, release this rank's cached blocks
        and cap it at ``fraction`` of its GPU; or (None) lift the cap and restore what was offloaded; on
        the device its model lives on (:mod:`megarl.training.memory_limit`)."""
        from megarl.training import memory_limit

        trainer = self.trainer
        mode = trainer.cfg.cluster.colocated_offload
        if fraction is None:
            memory_limit.lift(trainer.device)
            memory_limit.restore(trainer.optimizer, trainer.model_chunks, mode, trainer.device)
            return {}
        memory_limit.offload(trainer.optimizer, trainer.model_chunks, mode, trainer.device)
        return memory_limit.shrink(trainer.device, fraction)

    def sft_step(self, batch: Any, lr: float) -> dict[str, float]:
        """One SFT (masked NLL) step on this rank's trainer (:func:`megarl.launch.sft.sft_step`)."""
        from megarl.launch.sft import sft_step

        return sft_step(self.trainer, batch, lr=lr)

    def connect_weight_sync(self, engine_urls: list[str], directory: str) -> None:
        """Build this rank's weight synchronizer to ``engine_urls`` (collective over the ranks)."""
        from megarl.config.device import resolved_precision
        from megarl.weight_sync.choice import run_senders, run_transport
        from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

        cfg = self.trainer.cfg
        transport = run_transport(cfg, cuda=use_cuda(cfg.cluster.device))  # auto: tensor when colocated on CUDA
        # senders auto: segment when colocated; disaggregated: owner where it applies (build_weight_sync)
        ws = OmegaConf.merge(cfg.weight_sync, {"transport": transport, "senders": run_senders(cfg)})
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[resolved_precision(cfg)]
        spec = SyncSpec(hf_dir=cfg.model.hf_path, engine_urls=engine_urls,
                        engine_tp_size=int(cfg.rollout.engine.tensor_parallel_size),
                        engine_ep_size=int(cfg.rollout.engine.expert_parallel_size), dtype=dtype,
                        make_vocab_size_divisible_by=int(cfg.model.make_vocab_size_divisible_by),
                        directory=directory, master_address=ray.util.get_node_ip_address(),
                        port_base=int(cfg.cluster.master_port) or None)
        self.syncer = build_weight_sync(spec, self.trainer.parallel, ws, parallel_cfg=cfg.parallel)

    def close_weight_sync(self) -> None:
        """Tear the synchronizer down (an engine was restarted: its groups must be rebuilt)."""
        syncer, self.syncer = self.syncer, None
        if syncer is not None:
            try:
                syncer.close()
            except Exception as e:  # noqa: BLE001 - the restarted engine no longer knows the old group
                logger.warning("closing the weight-sync groups: %s", e)

    def sync_weights(self, policy_version: int, load_proof: bool | None = None) -> dict[str, float]:
        """Push this rank's shards (pause, push, flush, version, continue; see `WeightSynchronizer.sync`)."""
        return self.syncer.sync(dict(self.trainer.named_parameters_for_sync()), policy_version, load_proof=load_proof)

    def verify_weights(self, probes: Any, tolerance: float) -> dict[str, float]:
        """Trainer logprobs of ``probes`` (a TrainBatch; collective) vs every engine's (rank 0 asks them)."""
        from megarl.weight_sync.verify import verify_engine_logprobs

        # SGLang scores prompt tokens with log_softmax(logits) whatever the sampling temperature,
        # so the trainer's side of the comparison is taken at temperature 1 too.
        logprobs = self.trainer.compute_logprobs(probes, temperature=1.0)
        if self.syncer.engines is None or not self.syncer.is_coordinator:
            return {}
        cu = probes.cu_seqlens.tolist()
        per_probe = [logprobs[a + 1:b].double() for a, b in zip(cu[:-1], cu[1:])]
        ids = [probes.input_ids[a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
        return verify_engine_logprobs(self.syncer.engines, ids, per_probe, tolerance=tolerance)

    def pid(self) -> int:
        """The process id (for fault-injection tests)."""
        return os.getpid()


class TrainerGroup:
    """All trainer ranks of a run.

    Args:
        cfg: the resolved run config (a DictConfig of :class:`~megarl.config.schema.MegarlConfig`).
        placement: where the ranks go, and whether on CUDA (:class:`megarl.cluster.placement.Placement`).
        env: extra environment for every rank.
        setup_timeout_s: seconds to wait for every rank to build its trainer (default
            ``cluster.trainer_setup_timeout_s``); calls wait ``cluster.trainer_call_timeout_s``.

    Raises:
        TrainerGroupError: a rank failed to start.
    """

    def __init__(self, cfg: MegarlConfig, placement: Placement, env: dict[str, str] | None = None,
                 setup_timeout_s: float | None = None) -> None:
        self.world_size = trainer_world_size(cfg.cluster)
        self.timeout_s = float(cfg.cluster.trainer_call_timeout_s)
        self.colocated_fraction = float(cfg.cluster.colocated_trainer_memory_fraction)
        setup_timeout_s = float(cfg.cluster.trainer_setup_timeout_s if setup_timeout_s is None else setup_timeout_s)
        env = dict(env or {})
        self.workers = [TrainerWorker.options(**placement.trainer_options(r), name=None)  # type: ignore[attr-defined]  # a Ray actor class
                        .remote(r, self.world_size, env) for r in range(self.world_size)]
        # Rank 0's node hosts the rendezvous: only it takes a port (from the one allocator).
        infos = self._gather([w.node_info.remote(int(cfg.cluster.master_port) if r == 0 else None)
                              for r, w in enumerate(self.workers)], setup_timeout_s)
        master_ip, master_port = infos[0][1], infos[0][2]
        local_ranks = _local_ranks([info[0] for info in infos])
        cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        logger.info("trainer group: %d ranks, rendezvous %s:%d", self.world_size, master_ip, master_port)
        threads: list[int | None] = [None] * self.world_size
        if placement.cuda and "OMP_NUM_THREADS" not in os.environ:
            per_node = {node: local_ranks[r] + 1 for r, (node, *_) in enumerate(infos)}  # ranks per node
            threads = [omp_threads(info[3], per_node[info[0]]) for info in infos]
        self._gather([w.setup.remote(master_ip, master_port, lr, cfg_yaml, n)
                      for w, lr, n in zip(self.workers, local_ranks, threads)], setup_timeout_s)
        layout = self._gather([w.dp_rank.remote() for w in self.workers], setup_timeout_s)
        self.dp_ranks = [d for d, _, _ in layout]
        """Each rank's data-parallel rank (rank order)."""
        self.dp_size, self.cp_size = layout[0][1], layout[0][2]

    def _gather(self, refs: Sequence[Any], timeout_s: float | None) -> list[Any]:
        """``ray.get`` of one call per rank; on the first failure or timeout, kill the group and raise."""
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
                if not done:
                    raise TimeoutError(f"{len(pending)} trainer ranks did not answer in {timeout_s}s")
                ray.get(done[0])  # raises at once if that rank failed
            return ray.get(list(refs))
        except Exception as e:
            self.shutdown()
            raise TrainerGroupError(f"trainer group failed: {e}") from e

    def prepare(self, shards: Sequence[Any]) -> dict[str, float]:
        """Hand every rank its data-parallel shard of an RL step and prepare it there (old /
        reference logprobs, R2 routes); the shards stay on the ranks for `train_step`.

        Each shard is put in the object store once and read by the ranks of its data-parallel
        group only; nothing of batch size comes back.

        Args:
            shards: ``dp_size`` `megarl.training.shard.BatchShard` (``shard_batch``), rank order.

        Returns:
            The ranks' ``mismatch/*`` metrics, reduced over every shard (rank 0's copy).

        Raises:
            ValueError: not one shard per data-parallel rank.
            TrainerGroupError: a rank failed or did not answer in ``cluster.trainer_call_timeout_s``.
        """
        if len(shards) != self.dp_size:
            raise ValueError(f"{len(shards)} shards for {self.dp_size} data-parallel ranks")
        refs = [ray.put(shard) for shard in shards]
        return self._gather([w.prepare.remote(refs[d]) for w, d in zip(self.workers, self.dp_ranks)],
                            self.timeout_s)[0]

    def train_step(self, mini: int) -> dict[str, float]:
        """One optimizer step on mini-batch ``mini`` of the shards given to `prepare`.

        Returns:
            The step's metrics, reduced on the ranks (rank 0's copy).

        Raises:
            TrainerGroupError: a rank failed or did not answer in ``cluster.trainer_call_timeout_s``.
        """
        return self._gather([w.train_step.remote(int(mini)) for w in self.workers], self.timeout_s)[0]

    def save_checkpoint(self, directory: str) -> None:
        """Every rank saves its part of a checkpoint to ``directory`` (`Trainer.save_checkpoint`).

        Raises:
            TrainerGroupError: a rank failed or did not answer in ``cluster.trainer_call_timeout_s``.
        """
        self._gather([w.save_checkpoint.remote(directory) for w in self.workers], self.timeout_s)

    def load_checkpoint(self, directory: str) -> None:
        """Every rank loads its part of the checkpoint in ``directory`` (`Trainer.load_checkpoint`).

        Raises:
            TrainerGroupError: a rank failed or did not answer in ``cluster.trainer_call_timeout_s``.
        """
        self._gather([w.load_checkpoint.remote(directory) for w in self.workers], self.timeout_s)

    def colocated_memory(self, cap: bool) -> dict[str, float]:
        """Every rank's :meth:`TrainerWorker.colocated_memory`: cap at ``cluster.colocated_trainer_memory_fraction``
        (``cap``), or lift the cap; rank 0's numbers.

        Raises:
            TrainerGroupError: a rank still holds more than its fraction after releasing its cache.
        """
        fraction = self.colocated_fraction if cap else None
        return self._gather([w.colocated_memory.remote(fraction) for w in self.workers], self.timeout_s)[0]

    def sft_step(self, batch: Any, *, lr: float) -> dict[str, float]:
        """One SFT step on every rank (the batch put in the object store once); the (identical)
        metrics of rank 0."""
        batch = ray.put(batch)
        return self._gather([w.sft_step.remote(batch, lr) for w in self.workers], self.timeout_s)[0]

    def connect_weight_sync(self, engine_urls: list[str], directory: str) -> None:
        """Build every rank's weight synchronizer to ``engine_urls`` (`TrainerWorker.connect_weight_sync`)."""
        urls = ray.put(engine_urls)  # one copy in the object store for every rank
        self._gather([w.connect_weight_sync.remote(urls, directory) for w in self.workers], self.timeout_s)

    def close_weight_sync(self, *, timeout_s: float | None = None) -> None:
        """Tear every rank's synchronizer down (an engine was restarted: its groups must be rebuilt).

        Args:
            timeout_s: seconds to wait for the ranks (default ``cluster.trainer_call_timeout_s``).
        """
        self._gather([w.close_weight_sync.remote() for w in self.workers], timeout_s or self.timeout_s)

    def sync_weights(self, policy_version: int, load_proof: bool | None = None) -> dict[str, float]:
        """Every rank pushes its shards to the engines (`TrainerWorker.sync_weights`: pause -> push
        -> flush -> version -> continue; ``load_proof`` there); the metrics of rank 0 (the coordinator).

        Raises:
            TrainerGroupError: a rank failed or did not answer in ``cluster.trainer_call_timeout_s``.
        """
        return self._gather([w.sync_weights.remote(policy_version, load_proof) for w in self.workers],
                            self.timeout_s)[0]

    def verify_weights(self, probes: Any, tolerance: float) -> list[dict[str, float]]:
        """Trainer logprobs of ``probes`` (a TrainBatch, put in the object store once) against every
        engine's (`TrainerWorker.verify_weights`); each rank's result in rank order (the
        coordinator's holds the metrics, the others are empty)."""
        probes = ray.put(probes)
        return self._gather([w.verify_weights.remote(probes, tolerance) for w in self.workers], self.timeout_s)

    def pids(self) -> list[int]:
        """Process ids of the ranks."""
        return ray.get([w.pid.remote() for w in self.workers], timeout=60)

    def shutdown(self) -> None:
        """Kill every rank (idempotent)."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.workers = []


def omp_threads(node_cpus: int, ranks_on_node: int) -> int:
    """Intra-op threads of one trainer rank: the node's cores shared by its ranks (at least 1).

    Ray sets ``OMP_NUM_THREADS`` to an actor's CPU request (1), which starves a GPU rank's host work
    (data packing, optimizer on CPU, checkpoint I/O)."""
    return max(1, node_cpus // max(1, ranks_on_node))


def _local_ranks(node_ids: Sequence[str]) -> list[int]:
    """Index of each rank among the ranks on its node, in rank order."""
    seen: dict[str, int] = {}
    out = []
    for node in node_ids:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def _free_port(base: int = 0) -> int:
    """The rendezvous port: free on every interface of this node, at or above ``base`` (0: no base;
    a random start below the kernel's ephemeral range, where ``bind(0)`` would race with outgoing
    connections), and reserved on the node (two groups starting at once get different ports).

    Raises:
        RuntimeError: no free port in ``[base, base + PORT_SPAN)`` (names the range).
    """
    return find_free_port("", base or None)
