"""A trainer rank's :class:`~megarl.weight_sync.sync.WeightSynchronizer`, built from the policy's HF
directory, the trainer's parallel state, the ``weight_sync`` config section and the engines
(:class:`SyncSpec`): plan, conversion placement, manifest check, transport options."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from megarl.config.sync_transports import one_sender_per_stage
from megarl.models.families import get_family
from megarl.training.model import load_hf_config
from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.fp8_wire import served_quantization
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.manifest_checks import read_manifest
from megarl.weight_sync.model_specs import engine_table, param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.sync import WeightSynchronizer


@dataclass(frozen=True, kw_only=True)
class SyncSpec:
    """What a weight sync needs besides the ``weight_sync`` section: the model, the engines, where
    the bytes go (the same on every trainer rank)."""

    hf_dir: str | os.PathLike
    """The policy's HF directory: architecture; the engines' checkpoint for the manifest check; its
    ``quantization_config`` (block-FP8 engines get FP8 weights, :mod:`megarl.weight_sync.fp8_wire`)."""
    engine_urls: Sequence[str]
    """Every engine to update."""
    engine_tp_size: int = 1
    """Every engine's ``--tp``."""
    engine_ep_size: int = 1
    """Every engine's ``--ep-size``."""
    engine_device: str | None = None
    """Where the engines run (``cuda`` / ``cpu``: a CPU engine pads MLP sizes, which moves its ranks' slices,
    :class:`~megarl.weight_sync.layout.EngineLayout`); None: this process's kind, ``cuda`` where torch sees
    a GPU, else ``cpu`` (engines megarl starts run on the trainer's kind of device)."""
    dtype: str = "bfloat16"
    """The trainer's parameter dtype (``float32`` on CPU tests)."""
    make_vocab_size_divisible_by: int = 128
    """``model.make_vocab_size_divisible_by``."""
    check_manifest: bool = True
    """Check the plan against ``hf_dir``'s safetensors headers (engines on the same host)."""
    directory: str | os.PathLike | None = None
    """Where the ``disk`` transport writes."""
    master_address: str = "127.0.0.1"
    """Address of this host as the engines reach it (group transports)."""
    port_base: int | None = None
    """Where group transports' ports start on this host (``cluster.master_port``; None: no base)."""


def engine_device(spec: SyncSpec) -> str:
    """``spec.engine_device``, or where it is None ``cuda`` if torch sees a GPU here, else ``cpu``."""
    if spec.engine_device is not None:
        return spec.engine_device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_layout_of(parallel, parallel_cfg=None) -> TrainerLayout:
    """The :class:`TrainerLayout` of a trainer's ``ParallelState`` (uneven stages from ``parallel_cfg``,
    the ``parallel`` section; None: even stages)."""
    first = parallel_cfg.num_layers_in_first_pipeline_stage if parallel_cfg is not None else None
    last = parallel_cfg.num_layers_in_last_pipeline_stage if parallel_cfg is not None else None
    return TrainerLayout(
        tensor_model_parallel_size=parallel.tp_size, pipeline_model_parallel_size=parallel.pp_size,
        expert_model_parallel_size=parallel.ep_size, expert_tensor_parallel_size=parallel.etp_size,
        virtual_pipeline_model_parallel_size=parallel.vpp_size, context_parallel_size=parallel.cp_size,
        data_parallel_size=parallel.dp_size,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)


def senders_per_stage(cfg, senders: str | None = None) -> int | None:
    """``weight_sync.senders_per_stage`` for ``build_plan``: 1 for the transports with one sender
    per stage (their registry entry's ``one_sender``: ``shard``, ``tensor``, ``disk``, same host or
    files) and for owner senders (every rank sends; ``assign_senders`` splits the engines over the
    copies; ``senders``: the resolved value, default ``cfg.senders`` with ``auto`` resolved by the
    transport's name, :func:`~megarl.weight_sync.owners.auto_senders`), else the config's value."""
    from megarl.weight_sync.owners import auto_senders

    senders = senders or (auto_senders(cfg.transport) if cfg.senders == "auto" else cfg.senders)
    if one_sender_per_stage(cfg.transport) or senders == "owner":  # owner: copies split engines themselves
        return 1
    return cfg.senders_per_stage


def owner_applies(plan, transport: str, engine_urls: Sequence[str], *, timeout_s: float = 60.0) -> bool:
    """Whether ``weight_sync.senders=auto`` may resolve to ``owner`` (:func:`build_weight_sync`): SGLang
    loads every tensor pre-sharded at the engine layout (the plan's engine slices exist), and, with
    ``weight_sync.transport=auto``, every engine registered megarl's receiver loader (engines megarl
    starts do; else ``auto`` resolves to ``distributed``, :func:`~megarl.weight_sync.choice.resolve_auto`)."""
    from megarl.weight_sync.choice import engines_have_receiver
    from megarl.weight_sync.engine_clients import EngineClients
    from megarl.weight_sync.engine_slices import PlanError

    try:
        plan.engine_shard_bytes()
    except PlanError:
        return False
    if transport != "auto":
        return True
    engines = EngineClients(list(engine_urls))
    try:
        return engines_have_receiver(engines, timeout_s=timeout_s)
    finally:
        engines.close()


def build_weight_sync(spec: SyncSpec, parallel, cfg, *, parallel_cfg=None, group=None) -> WeightSynchronizer:
    """A :class:`WeightSynchronizer` for a trainer rank (call on every rank, same arguments).

    ``cfg.senders=auto`` resolves to ``owner`` (and the transport to ``p2p``) where
    :func:`owner_applies`, else to ``segment`` (the transport as configured).

    Args:
        spec: the model and the engines (:class:`SyncSpec`).
        parallel: this rank's ``megarl.training.parallel_state.ParallelState``.
        cfg: the ``weight_sync`` config section (transport, bucket size, senders, backend, pause
            mode, timeout).
        parallel_cfg: the ``parallel`` section (uneven pipeline stages), optional.
        group: the trainer's process group (default group if None).

    Raises:
        WeightSyncError / PlanError / LayoutError / SpecError: see the checks they name.
    """
    from megarl.weight_sync.owners import auto_senders

    hf_config = load_hf_config(str(spec.hf_dir))
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=parallel.tp_size,
                                       make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
                                       dtype=spec.dtype)
    engine_layout = EngineLayout(tensor_parallel_size=spec.engine_tp_size, expert_parallel_size=spec.engine_ep_size,
                                 num_engines=len(spec.engine_urls), device=engine_device(spec))

    def plan_for(senders: str):
        return build_plan(trainer_layout_of(parallel, parallel_cfg), engine_layout, specs,
                          bucket_size_mb=cfg.bucket_size_mb,
                          quantization=served_quantization(hf_config, source=f"{spec.hf_dir}/config.json"),
                          senders_per_stage=senders_per_stage(cfg, senders),
                          spread_experts=senders == "owner")  # owner: buckets over every owner and engine rank

    transport, senders = cfg.transport, cfg.senders
    if senders == "auto":
        senders = auto_senders(transport)
    plan = plan_for(senders)
    if cfg.senders == "auto" and senders == "owner":
        if owner_applies(plan, transport, spec.engine_urls):
            transport = "p2p"
        else:
            senders = "segment"
            plan = plan_for(senders)
    family = get_family(hf_config)
    layout = family.layout(hf_config, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
                           tp_size=parallel.tp_size)
    return WeightSynchronizer(plan, transport, list(spec.engine_urls), rank=parallel.rank,
                              placement=Placement(layout, engine_table(family, hf_config), family.sync_shard_view,
                                                  engine_tp_size=spec.engine_tp_size),
                              manifest=read_manifest(spec.hf_dir) if spec.check_manifest else None,
                              pause_mode=cfg.pause_mode, group=group, senders=senders,
                              backend=cfg.backend, master_address=spec.master_address, port_base=spec.port_base,
                              directory=spec.directory,
                              timeout_s=cfg.timeout_s, load_proof=cfg.load_proof != "off")
