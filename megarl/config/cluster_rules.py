"""The rules of the cluster section: devices for the engines, placement against transport and memory,
engines packed onto nodes, and the Slurm allocation's sizes (``MEGARL_ALLOC_*``)."""
from __future__ import annotations

import os

from megarl.config.checker import Checker, get_key
from megarl.config.device import resolved_precision, use_cuda
from megarl.config.parallel import trainer_world_size
from megarl.config.sync_transports import transport_entry
from megarl.plan.allocation import run_nodes, smaller_allocation

COLOCATED_MEMORY_LIMIT = 0.9
"""Colocated on CUDA: the most of a GPU's memory the engine's static pool and the trainer's share may
claim together (``rollout.engine.mem_fraction_static`` + ``cluster.colocated_trainer_memory_fraction``)."""


def check_cluster(c: Checker) -> None:
    """Devices for the engines, placement against the weight-sync transport, colocated memory and
    async mode on CUDA, and the run's nodes and devices against the allocation (``MEGARL_ALLOC_*``)."""
    cfg = c.cfg
    cl, r = cfg.cluster, cfg.rollout
    if r.external_engine_urls:
        return
    engine_devices = r.num_engines * r.engine.tensor_parallel_size
    if cl.placement == "disaggregated":
        available = cl.rollout_nodes * cl.rollout_devices_per_node
        c.check(engine_devices <= available, "rollout.num_engines",
                f"num_engines*engine.tensor_parallel_size = {engine_devices} devices, but the rollout "
                f"side has cluster.rollout_nodes*cluster.rollout_devices_per_node = {available}")
    else:
        world = trainer_world_size(cfg.cluster)
        c.check(engine_devices <= world, "rollout.num_engines",
                f"colocated engines need {engine_devices} devices; the trainer has {world}")
    _check_transport(c)
    if cl.placement == "colocated":
        engine, trainer = r.engine.mem_fraction_static, cl.colocated_trainer_memory_fraction
        c.check(not use_cuda(cl.device) or engine + trainer <= COLOCATED_MEMORY_LIMIT,
                "rollout.engine.mem_fraction_static",
                f"colocated engines keep rollout.engine.mem_fraction_static={engine} of each GPU while the trainer "
                f"keeps cluster.colocated_trainer_memory_fraction={trainer}: {engine + trainer:.2f} together, over "
                f"{COLOCATED_MEMORY_LIMIT} (the rest holds CUDA contexts, NCCL buffers and the engines' "
                "activations); lower one of them")
    if cl.colocated_offload != "none":
        c.check(cl.placement == "colocated", "cluster.colocated_offload",
                "offloads the trainer's state while colocated engines hold their memory: it needs "
                "cluster.placement=colocated")
        c.check(not use_cuda(cl.device) or resolved_precision(cfg) != "fp32", "cluster.colocated_offload",
                "with train.precision=fp32 the optimizer's parameters are the model's own (Megatron-Core's "
                "offload_to_cpu would move them out of the DDP buffer): use bf16, or cluster.colocated_offload=none")
    if cl.placement == "colocated" and cfg.rollout.async_mode:
        c.check(not use_cuda(cl.device), "rollout.async_mode",
                "colocated engines share their GPUs with the trainer: they lend it their memory only while "
                "they are idle, so generation cannot run during training; use cluster.placement=disaggregated "
                "for async RL")
    _check_allocation_nodes(c)
    alloc_gpus = os.environ.get("MEGARL_ALLOC_GPUS_PER_NODE")
    if alloc_gpus:
        for key in ("cluster.trainer_devices_per_node", "cluster.rollout_devices_per_node"):
            c.check(get_key(cfg, key) <= int(alloc_gpus), key,
                    f"more devices per node than the allocation's {alloc_gpus} (MEGARL_ALLOC_GPUS_PER_NODE)")


def _check_transport(c: Checker) -> None:
    """``weight_sync.transport`` against the placement and ``weight_sync.senders``, from what its registry
    entry declares (:mod:`megarl.config.sync_transports`; ``auto`` and unknown names have none: ``auto``
    is resolved per run, an unknown name is its domain's to report)."""
    ws, cl = c.cfg.weight_sync, c.cfg.cluster
    entry = transport_entry(ws.transport)
    if entry is not None and entry.colocated_only:
        c.check(cl.placement == "colocated", "weight_sync.transport",
                f"the {ws.transport} transport shares memory: it needs cluster.placement=colocated")
    if ws.senders == "owner":
        c.check(entry is not None and entry.owner_senders, "weight_sync.senders",
                f"weight_sync.senders=owner sends each engine rank its parts point to point: it needs "
                f"weight_sync.transport=p2p, got {ws.transport!r}")
    if cl.placement == "colocated" and entry is not None and entry.process_group:
        nccl = ws.backend == "nccl" or (ws.backend == "auto" and use_cuda(cl.device))
        c.check(not nccl, "weight_sync.transport",
                f"the {ws.transport} transport connects trainer and engine ranks over NCCL, which "
                "cannot connect a trainer rank to the engine rank on its own GPU (NCCL refuses two ranks on "
                "one device); colocated runs use weight_sync.transport=tensor (CUDA IPC)")


def _check_allocation_nodes(c: Checker) -> None:
    """The run's nodes against the allocation's (``MEGARL_ALLOC_NODES``); when they are more, the message
    says what fits there (`megarl.plan.allocation.smaller_allocation`)."""
    alloc_nodes = os.environ.get("MEGARL_ALLOC_NODES")
    if not alloc_nodes:
        return
    need = run_nodes(c.cfg)
    if need.nodes > int(alloc_nodes):
        c.check(False, "cluster.trainer_nodes",
                f"the run needs {need.nodes} nodes (trainer_nodes {need.trainer} + rollout_nodes {need.rollout}) "
                f"but the allocation has {alloc_nodes} (MEGARL_ALLOC_NODES): "
                + smaller_allocation(c.cfg, int(alloc_nodes)))


def check_engine_packing(c: Checker) -> None:
    """Each engine fits on one node (or spans whole nodes: :func:`_check_engine_nodes`), and the
    engines pack onto the nodes whole."""
    cfg = c.cfg
    cl, r = cfg.cluster, cfg.rollout
    if r.external_engine_urls:
        return
    tp = r.engine.tensor_parallel_size
    if cl.placement == "disaggregated":
        nodes, per_node, where = cl.rollout_nodes, cl.rollout_devices_per_node, "cluster.rollout_devices_per_node"
    else:
        nodes, per_node, where = cl.trainer_nodes, cl.trainer_devices_per_node, "cluster.trainer_devices_per_node"
    if tp < 1 or per_node < 1:
        return  # reported by the field checks
    if tp > per_node:
        _check_engine_nodes(c, tp, nodes, per_node, where)
        return
    per_node_engines = per_node // tp
    c.check(r.num_engines <= nodes * per_node_engines, "rollout.num_engines",
            f"{per_node_engines} engine(s) of TP {tp} fit on each of the {nodes} node(s) ({where}={per_node}, "
            f"engines never straddle nodes): at most {nodes * per_node_engines} engines")


def _check_engine_nodes(c: Checker, tp: int, nodes: int, per_node: int, where: str) -> None:
    """An engine larger than a node spans whole, consecutive nodes (SGLang's ``--nnodes``): only
    disaggregated, its devices a multiple of the node's, and the engines' nodes within the rollout's."""
    cfg = c.cfg
    if not c.check(cfg.cluster.placement == "disaggregated", "rollout.engine.tensor_parallel_size",
                   f"a colocated engine runs on one node: its {tp} devices exceed {where}={per_node} "
                   "(engines span nodes only with cluster.placement=disaggregated)"):
        return
    if not c.check(tp % per_node == 0, "rollout.engine.tensor_parallel_size",
                   f"an engine of {tp} devices would span a partial node ({where}={per_node}): an engine larger "
                   f"than a node spans whole nodes, so make it a multiple of {per_node}"):
        return
    span = tp // per_node
    c.check(cfg.rollout.num_engines * span <= nodes, "rollout.num_engines",
            f"each engine of TP {tp} spans {span} whole nodes ({where}={per_node}): {cfg.rollout.num_engines} "
            f"engines need {cfg.rollout.num_engines * span} nodes, cluster.rollout_nodes={nodes}")
