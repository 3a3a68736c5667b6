"""Which transport a weight sync uses: the registry of transports by name, ``weight_sync.transport=auto``
resolved per sender, the run-level choice for colocated CUDA engines, and what engines megarl
starts register for it."""
from __future__ import annotations

import logging

import torch

from megarl.weight_sync.engine_clients import EngineClients, wait_all
from megarl.weight_sync.engine_slices import PlanError
from megarl.weight_sync.p2p import CheckedDistributedTransport, P2PTransport
from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.receiver import RECEIVER
from megarl.weight_sync.transport import Transport, TransportOptions
from megarl.weight_sync.transports import LOADER, DiskTransport, DistributedTransport, ShardTransport, TensorTransport

log = logging.getLogger(__name__)

TRANSPORTS: dict[str, type[Transport]] = {cls.name: cls for cls in (
    P2PTransport, CheckedDistributedTransport, ShardTransport, TensorTransport, DiskTransport)}
"""``weight_sync.transport`` -> its class (``auto`` is resolved first, :func:`resolve_auto`)."""
UNCHECKED: dict[str, type[Transport]] = {"distributed": DistributedTransport}
"""What a transport falls back to when the engines did not register megarl's receiver loader:
SGLang's own ``/update_weights_from_distributed``, which loads what it received unchecked."""
ONE_SENDER_TRANSPORTS = ("shard", "tensor", "disk")
"""Transports with one sender per pipeline stage (same host or files): ``senders_per_stage`` is 1."""


def engines_have_receiver(engines: EngineClients, *, timeout_s: float = 60.0) -> bool:
    """Whether every engine registered megarl's receiver loader (``/server_info``'s ``custom_weight_loader``)."""
    infos = wait_all(engines.submit_all("_request", "GET", "/server_info", timeout_s=timeout_s), timeout_s)
    return all(RECEIVER in (info.get("custom_weight_loader") or []) for info in infos)


def resolve_auto(plan: WeightSyncPlan, engines: EngineClients, *, backend: str = "auto",
                 timeout_s: float = 60.0) -> str:
    """``weight_sync.transport=auto`` for one sender: ``p2p`` where it applies and is not predicted
    slower, else ``distributed``.

    ``p2p`` applies when every engine registered the receiver loader (``/server_info``'s
    ``custom_weight_loader``; megarl registers it in engines it starts) and SGLang can load every
    tensor pre-sharded at this engine layout (the plan's engine slices). It is chosen with gloo
    (whose broadcast sends the whole bucket to every engine rank separately, so ``p2p`` moves
    ``1 / T`` of the bytes) and with NCCL when this sender serves one engine (``engines`` are the
    engines of this sender's replica: with ``senders_per_stage`` replicas, as many engines get a
    sender of their own). With NCCL and several engines per sender a pipelined broadcast carries
    each byte once per link while ``p2p`` sends each engine its shards one after another
    (``megarl plan-sync`` shows both), so ``distributed`` stays there.
    """
    try:
        plan.engine_shard_bytes()
    except PlanError:
        return "distributed"
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    if backend == "nccl" and len(engines) > 1:
        return "distributed"
    return "p2p" if engines_have_receiver(engines, timeout_s=timeout_s) else "distributed"


def make_transport(name: str, plan: WeightSyncPlan, engines: EngineClients, **options) -> Transport:
    """The transport called ``name`` (``weight_sync.transport``; ``auto``: see :func:`resolve_auto`).

    ``distributed`` is checked per bucket (:class:`~megarl.weight_sync.p2p.CheckedDistributedTransport`)
    when every engine registered megarl's receiver loader, as engines megarl starts do; otherwise it
    is SGLang's own ``/update_weights_from_distributed`` (:data:`UNCHECKED`), which loads what it
    received unchecked (README, "A sync that checks itself"), and a warning says so.

    Args:
        options: the fields of :class:`~megarl.weight_sync.transport.TransportOptions`
            (``backend``, ``master_address``, ``directory``, ``timeout_s``).

    Raises:
        ValueError: unknown name, or ``disk`` without a directory.
    """
    opts = TransportOptions(**options)
    if name == "auto":
        name = resolve_auto(plan, engines, backend=opts.backend, timeout_s=opts.timeout_s)
        log.info("weight_sync.transport=auto -> %s (%d engine(s) for this sender)", name, len(engines))
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise ValueError(f"weight_sync.transport: unknown {name!r} (auto, {', '.join(TRANSPORTS)})")
    if name in UNCHECKED and not engines_have_receiver(engines, timeout_s=opts.timeout_s):
        log.warning("weight_sync.transport=%s: the engines did not register megarl's receiver "
                    "(--custom-weight-loader %s): buckets are loaded without a per-bucket checksum check",
                    name, RECEIVER)
        cls = UNCHECKED[name]
    return cls.from_options(plan, engines, opts)


def run_transport(cfg, *, cuda: bool) -> str:
    """The transport a run config asks for: ``weight_sync.transport``, with ``auto`` meaning
    ``tensor`` when trainer and engines share CUDA devices (``cluster.placement=colocated`` and
    ``cuda``, ``cluster.device`` resolved: :func:`megarl.config.device.use_cuda`; NCCL cannot
    connect two ranks on one GPU); otherwise ``auto`` is resolved by the senders (:func:`resolve_auto`)."""
    transport = cfg.weight_sync.transport
    if transport == "auto" and cfg.cluster.placement == "colocated" and cuda:
        return "tensor"
    return transport


def engine_custom_weight_loaders(transport: str) -> list[str]:
    """What engines megarl starts itself register with ``--custom-weight-loader`` for ``transport``
    (``auto`` registers the ``p2p`` receiver, so that ``auto`` resolves to ``p2p`` for them;
    ``distributed`` registers it so that every bucket is checked before loading)."""
    if transport == "shard":
        return [LOADER]
    if transport in ("auto", "p2p"):
        return [LOADER, RECEIVER]
    if transport == "distributed":
        return [RECEIVER]
    return []
