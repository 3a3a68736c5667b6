"""Which transport a weight sync uses: the one named in the transport registry
(:data:`megarl.config.sync_transports.TRANSPORTS`, names or import paths), ``weight_sync.transport=auto``
resolved per sender, the run-level choice for colocated CUDA engines, and what engines megarl
starts register for it (the entry's ``engine_loaders``)."""
from __future__ import annotations

import logging

import torch

from megarl.config.sync_transports import TRANSPORTS, one_sender_per_stage
from megarl.weight_sync.engine_clients import EngineClients, wait_all
from megarl.weight_sync.engine_slices import PlanError
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.receiver import RECEIVER
from megarl.weight_sync.transport import Transport, TransportOptions

log = logging.getLogger(__name__)


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
    """The transport ``name`` names (``weight_sync.transport``: a registered name or an import path;
    ``auto``: see :func:`resolve_auto`).

    A transport with an ``unchecked`` fallback (``distributed``: checked per bucket by
    :class:`~megarl.weight_sync.p2p.CheckedDistributedTransport`) uses it when an engine did not
    register megarl's receiver loader (engines megarl starts do): for ``distributed`` SGLang's own
    ``/update_weights_from_distributed``, which loads what it received unchecked (README, "A sync
    that checks itself"), and a warning says so.

    Args:
        options: the fields of :class:`~megarl.weight_sync.transport.TransportOptions`
            (``backend``, ``master_address``, ``directory``, ``timeout_s``).

    Raises:
        ValueError: an unknown name or an import path that does not load (``PluginError``, naming
            ``weight_sync.transport``), or ``disk`` without a directory.
    """
    opts = TransportOptions(**options)
    if name == "auto":
        name = resolve_auto(plan, engines, backend=opts.backend, timeout_s=opts.timeout_s)
        log.info("weight_sync.transport=auto -> %s (%d engine(s) for this sender)", name, len(engines))
    entry = TRANSPORTS.resolve(name)
    cls: type[Transport] = entry.load()
    if entry.unchecked is not None and not engines_have_receiver(engines, timeout_s=opts.timeout_s):
        log.warning("weight_sync.transport=%s: the engines did not register megarl's receiver "
                    "(--custom-weight-loader %s): buckets are loaded without a per-bucket checksum check",
                    name, RECEIVER)
        cls = entry.load(unchecked=True)
    return cls.from_options(plan, engines, opts)


def check_one_sender(transport: str, plan: WeightSyncPlan) -> None:
    """A transport with one sender per pipeline stage (its entry's ``one_sender``) gets a plan with one.

    Raises:
        WeightSyncError: ``transport`` has one sender per stage and ``plan.senders_per_stage`` > 1.
    """
    if one_sender_per_stage(transport) and plan.senders_per_stage > 1:
        raise WeightSyncError(f"weight_sync.transport={transport} has one sender per stage; the plan has "
                              f"senders_per_stage={plan.senders_per_stage} (build it with senders_per_stage=1)")


def run_transport(cfg, *, cuda: bool) -> str:
    """The transport a run config asks for: ``weight_sync.transport``, with ``auto`` meaning
    ``tensor`` when trainer and engines share CUDA devices (``cluster.placement=colocated`` and
    ``cuda``, ``cluster.device`` resolved: :func:`megarl.config.device.use_cuda`; NCCL cannot
    connect two ranks on one GPU); otherwise ``auto`` is resolved by the senders (:func:`resolve_auto`)."""
    transport = cfg.weight_sync.transport
    if transport == "auto" and cfg.cluster.placement == "colocated" and cuda:
        return "tensor"
    return transport


def run_senders(cfg) -> str:
    """The ``weight_sync.senders`` a run config hands the trainer ranks: its own value, with ``auto``
    meaning ``segment`` when trainer and engines are colocated (owner senders are the default of
    disaggregated runs; a colocated CUDA run uses ``tensor``); a disaggregated run's ``auto`` is
    resolved by :func:`megarl.weight_sync.synchronizer_build.build_weight_sync` (``owner`` where it applies)."""
    senders = cfg.weight_sync.senders
    return "segment" if senders == "auto" and cfg.cluster.placement == "colocated" else senders


def senders_on_paper(cfg) -> str:
    """The sender path a run config gets, on paper (``megarl plan-sync``): :func:`run_senders`, then
    ``auto`` by the transport's name (:func:`~megarl.weight_sync.owners.auto_senders`; the engines
    megarl starts register the receiver)."""
    from megarl.config.device import use_cuda
    from megarl.weight_sync.owners import auto_senders

    senders = run_senders(cfg)
    return auto_senders(run_transport(cfg, cuda=use_cuda(cfg.cluster.device))) if senders == "auto" else senders


def engine_custom_weight_loaders(transport: str) -> list[str]:
    """What engines megarl starts itself register with ``--custom-weight-loader`` for ``transport``:
    its entry's ``engine_loaders`` (``auto``: ``p2p``'s, so that ``auto`` resolves to ``p2p`` for
    them; ``distributed`` registers the receiver so that every bucket is checked before loading).

    Raises:
        ValueError: an unknown name or an import path that does not load (``PluginError``).
    """
    return list(TRANSPORTS.resolve("p2p" if transport == "auto" else transport).engine_loaders)
