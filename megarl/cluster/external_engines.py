"""The engines of an external engines job (``slurm/engines.sbatch``, ``python -m megarl.launch.slurm
serve-engines``): which engine parts each node runs, on which devices, and their command lines.

An engine that fits a node: ``MEGARL_ENGINES_PER_NODE`` engines per node, each on ``max(tp, ep)``
of the node's GPUs (``{name}-{k}``). An engine larger than a node (the Kimi-K2 recipe's TP16 on
8-GPU nodes) spans ``devices / devices per node`` consecutive nodes of the job as engines started
through Ray do (:mod:`megarl.cluster.ray_engines`): one SGLang process per node with ``--nnodes N
--node-rank r --dist-init-addr HEAD:PORT``, HEAD node-rank 0's address and a port from megarl's
allocator there. Node-rank 0 publishes that address in the registry (``engine{g}.rdzv``); the other
parts read it. Devices per node: the visible GPUs on CUDA, ``cluster.rollout_devices_per_node`` on
CPU. A layout whose engines do not fit the job's nodes is refused before any process starts (SGLang
would start a TP16 engine on 8 visible GPUs: ``gpu_id = base_gpu_id + tp_rank % tp_size_per_node``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.cluster.bundles import devices_per_engine
from megarl.config.schema import MegarlConfig
from megarl.procs.ports import find_free_port
from megarl.rollout.engine_resources import ENGINE_PORT_STRIDE


class ExternalEnginesError(ValueError):
    """The engines job cannot hold the config's engines (names the key and both numbers)."""


@dataclasses.dataclass(frozen=True)
class ServedEngine:
    """One engine part this node runs.

    Attributes:
        engine_id: ``{name}-{k}`` for an engine on one node; ``engine{g}`` (node-rank 0) or
            ``engine{g}.node{r}`` for the parts of engine ``g`` spanning nodes.
        index: the engine's index on this node (its port search starts at ``base_port + 10 * index``).
        nnodes, node_rank: the nodes the engine spans, this part's rank among them.
        devices: this part's GPU ids (``CUDA_VISIBLE_DEVICES``); empty on CPU.
    """

    engine_id: str
    index: int
    nnodes: int
    node_rank: int
    devices: tuple[str, ...]

    @property
    def head_id(self) -> str:
        """The engine's node-rank 0 id (its URL and rendezvous files are named after it)."""
        return self.engine_id.split(".node")[0]


def served_engines(cfg: MegarlConfig, *, name: str, node_index: int, num_nodes: int, engines_per_node: int,
                   cuda: bool, visible: Sequence[str]) -> list[ServedEngine]:
    """The engine parts node ``node_index`` of ``num_nodes`` runs.

    Args:
        cfg: the config (``rollout.engine`` TP/EP, ``cluster.rollout_devices_per_node`` on CPU).
        name: this node's prefix for one-node engines (its host name).
        engines_per_node: ``MEGARL_ENGINES_PER_NODE``.
        cuda: engines on GPUs; visible: this node's GPU ids (``CUDA_VISIBLE_DEVICES``).

    Raises:
        ExternalEnginesError: no GPU visible on CUDA; engines that do not fit a node's devices; an
            engine over several nodes with more than one engine per node, a TP not a multiple of
            the devices per node, or a node count not a multiple of the nodes per engine.
    """
    per_engine = devices_per_engine(cfg.rollout)
    per_node = len(visible) if cuda else int(cfg.cluster.rollout_devices_per_node)
    what = f"rollout.engine.tensor_parallel_size={int(cfg.rollout.engine.tensor_parallel_size)}"
    if cuda and not visible:
        raise ExternalEnginesError("serve-engines: no GPU visible on this node (CUDA_VISIBLE_DEVICES is empty)")
    if per_engine <= per_node:
        if per_engine * engines_per_node > per_node:
            raise ExternalEnginesError(
                f"{what}: {engines_per_node} engines per node (MEGARL_ENGINES_PER_NODE) need "
                f"{per_engine * engines_per_node} devices per node, the job's nodes have {per_node}")
        return [ServedEngine(f"{name}-{k}", k, 1, 0, tuple(visible[k * per_engine:(k + 1) * per_engine]))
                for k in range(engines_per_node)]
    parts = per_engine // per_node
    if per_engine % per_node or engines_per_node != 1 or num_nodes % parts:
        raise ExternalEnginesError(
            f"{what}: an engine of {per_engine} devices spans {per_engine / per_node:g} nodes of {per_node}; "
            f"it needs whole nodes (a multiple of {per_node} devices), one engine per node "
            f"(MEGARL_ENGINES_PER_NODE={engines_per_node}) and a node count that is a multiple of "
            f"{max(parts, 1)} (the job has {num_nodes})")
    group, rank = divmod(node_index, parts)
    engine_id = f"engine{group}" if rank == 0 else f"engine{group}.node{rank}"
    return [ServedEngine(engine_id, 0, parts, rank, tuple(visible))]


def rendezvous(part: ServedEngine, *, host: str, base_port: int, registry: Path, timeout_s: float) -> str | None:
    """``--dist-init-addr`` of ``part``'s engine (None on one node): node-rank 0 takes a port from
    megarl's allocator on this node (at or above ``base_port + 10 * index``) and publishes
    ``host:port`` as ``{registry}/{head_id}.rdzv`` (atomically); the other parts wait for it.

    Raises:
        TimeoutError: node-rank 0 did not publish within ``timeout_s`` (names the file).
    """
    if part.nnodes == 1:
        return None
    path = registry / f"{part.head_id}.rdzv"
    if part.node_rank == 0:
        port = find_free_port(host, base_port + ENGINE_PORT_STRIDE * part.index)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tmp = registry / f".{part.head_id}.rdzv.tmp"
        tmp.write_text(addr)
        tmp.replace(path)
        return addr
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{part.engine_id}: node-rank 0 published no {path} within {timeout_s:.0f}s")
        time.sleep(0.5)
    return path.read_text().strip()


def interface_of(addr: str) -> str | None:
    """The name of this host's network interface that holds IP address ``addr`` (``eth0``), or None
    when none does (a host name, ``0.0.0.0``)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return None


def engine_process(cfg: MegarlConfig, part: ServedEngine, *, host: str, device: str, registry: Path,
                   custom_weight_loaders: Sequence[str] = (), dist_init_addr: str | None = None) -> Any:
    """The :class:`~megarl.rollout.engine_process.EngineProcess` of ``part`` (the settings engines started
    through Ray get, :func:`megarl.cluster.ray_engines.engine_kwargs`, bound to ``host``; its HTTP
    port from megarl's allocator at or above ``base_port + 10 * index``), not started. A part of an
    engine spanning nodes also gets ``SGLANG_HOST_IP=host`` and ``GLOO_SOCKET_IFNAME`` (the one set,
    else :func:`interface_of` ``host``)."""
    from megarl.cluster.ray_engines import engine_kwargs
    from megarl.rollout.engine_process import EngineProcess

    env = {"CUDA_VISIBLE_DEVICES": ",".join(part.devices)} if part.devices else {}
    if part.nnodes > 1:  # SGLang's cross-node queue advertises this address (as EngineActor pins it)
        env["SGLANG_HOST_IP"] = host
        # Its gloo groups bind that address's interface, as on Ray nodes (slurm/lib/ray_node.sh);
        # otherwise torch's gloo binds what the host name resolves to, or loopback when that is none
        # of the host's addresses (/etc/hosts often maps the name to 127.0.0.1), out of the other
        # nodes' reach.
        ifname = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(host)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
    kwargs = engine_kwargs(cfg, device=device, log_path=str(registry / f"{part.engine_id}.log"),
                           engine_id=part.engine_id, custom_weight_loaders=custom_weight_loaders, env=env)
    kwargs["host"] = host
    if part.nnodes > 1:
        kwargs.update(nnodes=part.nnodes, node_rank=part.node_rank, dist_init_addr=dist_init_addr)
    port = find_free_port(host, int(cfg.rollout.engine.base_port) + ENGINE_PORT_STRIDE * part.index)
    return EngineProcess(cfg.model.hf_path, port=port, **kwargs)
