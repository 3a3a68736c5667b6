"""Which transport a weight sync uses: ``weight_sync.transport=auto`` resolved per sender, the
run-level choice for colocated CUDA engines, and what engines megarl starts register for it."""
from __future__ import annotations

import torch

from megarl.weight_sync.engines import EngineGroup, wait_all
from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.receiver import RECEIVER

ONE_SENDER_TRANSPORTS = ("shard", "tensor", "disk")
"""Transports with one sender per pipeline stage (same host or files): ``senders_per_stage`` is 1."""


def engines_have_receiver(engines: EngineGroup, *, timeout_s: float = 60.0) -> bool:
    """Whether every engine registered megarl's receiver loader (``/server_info``'s ``custom_weight_loader``)."""
    infos = wait_all(engines.submit_all("_request", "GET", "/server_info", timeout_s=timeout_s), timeout_s)
    return all(RECEIVER in (info.get("custom_weight_loader") or []) for info in infos)


def resolve_auto(plan: WeightSyncPlan, engines: EngineGroup, *, backend: str = "auto", timeout_s: float = 60.0) -> str:
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
    from megarl.weight_sync.plan import PlanError

    try:
        plan.engine_shard_bytes()
    except PlanError:
        return "distributed"
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    if backend == "nccl" and len(engines) > 1:
        return "distributed"
    return "p2p" if engines_have_receiver(engines, timeout_s=timeout_s) else "distributed"


def run_transport(cfg) -> str:
    """The transport a run config asks for: ``weight_sync.transport``, with ``auto`` meaning
    ``tensor`` when trainer and engines share CUDA devices (``cluster.placement=colocated``: NCCL
    cannot connect two ranks on one GPU); otherwise ``auto`` is resolved by the senders
    (:func:`resolve_auto`)."""
    from megarl.config.device import use_cuda

    transport = cfg.weight_sync.transport
    if transport == "auto" and cfg.cluster.placement == "colocated" and use_cuda(cfg.cluster.device):
        return "tensor"
    return transport


def engine_custom_weight_loaders(transport: str) -> list[str]:
    """What engines megarl starts itself register with ``--custom-weight-loader`` for ``transport``
    (``auto`` registers the ``p2p`` receiver, so that ``auto`` resolves to ``p2p`` for them;
    ``distributed`` registers it so that every bucket is checked before loading)."""
    from megarl.weight_sync.transports import LOADER

    if transport == "shard":
        return [LOADER]
    if transport in ("auto", "p2p"):
        return [LOADER, RECEIVER]
    if transport == "distributed":
        return [RECEIVER]
    return []
