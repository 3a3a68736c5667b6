"""A weight sync on paper: bytes per link and per engine rank, and a predicted time (``megarl plan-sync``).

From metadata alone (the model's ``config.json`` and the run config's layouts) the plan gives, for
each pipeline stage, the bytes its sender gathers from the other trainer ranks of the stage and the
bytes it sends to the engines, and for each engine rank the bytes it receives. The time model:

- a stage sender gathers over NVLink from ranks on its node (``intra_gbps``) and over the network
  from the others (``inter_gbps``), and sends over its own network link (``inter_gbps``); the
  gather of bucket ``b + 1`` overlaps the send of ``b``, so a stage takes
  ``max(gather_s, send_s)``;
- with ``senders_per_stage`` R, R replicas of the stage do this side by side, each over its own
  link to its own engines (``i % R == k``); the stage takes its slowest replica;
- stages push one after another (both transports share the engines' collectives):
  ``predicted_s = sum over stages``;
- ``p2p``: a sender's link carries each engine rank's shard once per engine it serves
  (``engines * sum_r shard_r``); with segment senders (``weight_sync.senders: segment``, BF16 on
  the wire) each engine rank's segment of each bucket is sent by the trainer rank holding most of
  it (:class:`~megarl.weight_sync.segments.SegmentOwners`), which first gathers the rest of it from
  the ranks holding it: every sending rank of a stage has its own row (its gather, its link), and
  the stage takes its slowest one; ``distributed``: a pipelined (ring / tree) NCCL broadcast
  carries the stage's bytes once per link whatever the number of receivers, but every engine rank
  receives all of them;
- engines serving a block-FP8 checkpoint receive FP8 weights and scales (the plan's wire
  tensors: about half the BF16 bytes); the gather moves the trainer's BF16 shards.

Beside these (the segment and stage sending paths), ``megarl plan-sync`` prints the physical bound
(the busiest engine rank's own bytes over its own link) and owner senders on paper, as they run
(:mod:`megarl.weight_sync.owner_predict`, on the owner senders' own plan); ``megarl plan`` prints
the same seconds for the path that runs (:func:`sync_seconds`). Both read the links of the
``cluster.gpu`` preset (``megarl.plan.gpus``) unless given (:func:`link_speeds`).

Not modelled: HTTP / ticket latency per bucket, the engines' load time, conversion copies on the
sender, link contention with training traffic. A lower bound to compare designs, not a promise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.weight_sync.choice import senders_on_paper
from megarl.weight_sync.owner_predict import format_owner_prediction, predict_owner_senders
from megarl.weight_sync.plan import WeightSyncPlan

GB = 1e9


@dataclass
class StagePrediction:
    """One sender of one stage (one row per replica)."""

    pp_rank: int
    sender_rank: int
    hf_bytes: int
    """HF bytes of the stage's buckets."""
    gather_intra_bytes: int
    gather_inter_bytes: int
    send_bytes: int
    """Bytes on the sender's network link."""
    seconds: float
    replica: int = 0
    """Which copy of the stage sends (``plan.senders_per_stage``)."""
    engines: int = 1
    """Engines this sender serves."""


@dataclass
class SyncPrediction:
    """One transport's sync on paper: per stage, bytes per engine rank and its shard, seconds."""
    transport: str
    stages: list[StagePrediction] = field(default_factory=list)
    engine_rank_bytes: list[int] = field(default_factory=list)
    """Bytes each rank of one engine receives."""
    engine_shard_bytes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    engine_rank_node: list[int] = field(default_factory=list)
    """Which of its engine's nodes each engine rank is on (all 0 unless the engine spans nodes:
    ``megarl.cluster.bundles.engine_nodes``); empty when not known (no run config)."""


def predict_sync(plan: WeightSyncPlan, transport: str, *, ranks_per_node: int, intra_gbps: float,
                 inter_gbps: float, placement=None) -> SyncPrediction:
    """Bytes per link and per engine rank and the predicted seconds of one sync (module docstring).

    Args:
        plan: the sync plan (``engine_layout.num_engines`` engines).
        transport: ``p2p`` or ``distributed``.
        ranks_per_node: trainer GPUs per node (ranks ``[k * n, (k + 1) * n)`` share node ``k``).
        intra_gbps / inter_gbps: NVLink and network bandwidth per GPU, GB/s (1e9 bytes).
        placement: the conversion's copy instructions (:class:`~megarl.weight_sync.copy_instructions.Placement`):
            ``p2p`` with segment senders (module docstring); None: one sender per stage.

    Raises:
        ValueError: another transport, or non-positive bandwidths / ranks per node.
    """
    if transport not in ("p2p", "distributed"):
        raise ValueError(f"plan-sync predicts p2p or distributed, not {transport!r}")
    if min(intra_gbps, inter_gbps) <= 0 or ranks_per_node < 1:
        raise ValueError("bandwidths must be > 0 GB/s and ranks_per_node >= 1")
    out = SyncPrediction(transport, engine_rank_bytes=plan.engine_rank_bytes(transport),
                         engine_shard_bytes=plan.engine_shard_bytes())
    replicas = [plan.for_replica(k) for k in range(plan.senders_per_stage)]
    for pp_rank in sorted({b.pp_rank for b in plan.buckets}):
        segments = transport == "p2p" and placement is not None and plan.quantization is None
        rows = [row for replica in replicas for row in (
            _segment_rows(replica, pp_rank, placement, ranks_per_node, intra_gbps, inter_gbps) if segments
            else [_sender_row(replica, pp_rank, transport, ranks_per_node, intra_gbps, inter_gbps)])]
        out.stages.extend(rows)
        out.seconds += max(row.seconds for row in rows)
    return out


def _sender_row(plan: WeightSyncPlan, pp_rank: int, transport: str, ranks_per_node: int, intra_gbps: float,
                inter_gbps: float) -> StagePrediction:
    """Bytes and seconds of the sender of stage ``pp_rank`` in a replica's plan."""
    buckets = plan.stage_buckets(pp_rank)
    sender = buckets[0].sender_rank
    intra = inter = 0
    for bucket in buckets:
        for rank, nbytes in bucket.gather_bytes().items():
            if rank // ranks_per_node == sender // ranks_per_node:
                intra += nbytes
            else:
                inter += nbytes
    engines = len(plan.engines) if plan.engines is not None else plan.engine_layout.num_engines
    if transport == "p2p":
        shard = [0] * plan.engine_layout.tp_size
        for bucket in buckets:
            for tensor in bucket.wire:
                for rank, sl in plan.engine_slices_of(tensor).items():
                    shard[rank] += math.prod(sl.shape(tensor.shape)) * tensor.itemsize
        send = engines * sum(shard)
    else:
        send = sum(b.wire_nbytes for b in buckets)
    gather_s = intra / (intra_gbps * GB) + inter / (inter_gbps * GB)
    seconds = max(gather_s, send / (inter_gbps * GB))
    return StagePrediction(pp_rank, sender, sum(b.nbytes for b in buckets), intra, inter, send, seconds,
                           plan.replica, engines)


def _segment_rows(plan: WeightSyncPlan, pp_rank: int, placement, ranks_per_node: int, intra_gbps: float,
                  inter_gbps: float) -> list[StagePrediction]:
    """One row per trainer rank sending segments of stage ``pp_rank`` (``p2p`` segment senders)."""
    from megarl.weight_sync.segments import SegmentOwners

    owners = SegmentOwners(plan, placement)
    engines = len(plan.engines) if plan.engines is not None else plan.engine_layout.num_engines
    rows: dict[int, list[int]] = {}  # sender -> [hf bytes, gather intra, gather inter, send]
    for bucket in plan.stage_buckets(pp_rank):
        segments = owners.layout(bucket)[0]
        for rank, (owner, held) in enumerate(zip(owners.owners(bucket), owners.holdings(bucket))):
            row = rows.setdefault(owner, [0, 0, 0, 0])
            row[3] += engines * segments[rank][1]
            for holder, nbytes in held.items():
                row[0] += nbytes
                if holder != owner:
                    row[1 if holder // ranks_per_node == owner // ranks_per_node else 2] += nbytes
    out = []
    for sender in sorted(rows):
        hf, intra, inter, send = rows[sender]
        gather_s = intra / (intra_gbps * GB) + inter / (inter_gbps * GB)
        out.append(StagePrediction(pp_rank, sender, hf, intra, inter, send, max(gather_s, send / (inter_gbps * GB)),
                                   plan.replica, engines))
    return out


def format_prediction(plan: WeightSyncPlan, predictions: list[SyncPrediction], *, intra_gbps: float,
                      inter_gbps: float, links: str = "given") -> str:
    """The ``megarl plan-sync`` report: one block per transport, bytes in GB (1e9)."""
    t, e = plan.trainer_layout, plan.engine_layout
    lines = [f"trainer TP{t.tp_size} PP{t.pp_size} EP{t.ep_size} ETP{t.etp_size} DP{t.data_parallel_size} "
             f"(world {t.world_size}) -> {e.num_engines} engine(s) TP{e.tp_size} EP{e.ep_size}; "
             f"{plan.total_bytes / GB:.2f} GB of HF tensors in {len(plan.buckets)} buckets"
             + (f", {plan.wire_bytes / GB:.2f} GB on the wire (block FP8)" if plan.quantization is not None else "")
             + f"; {plan.senders_per_stage} sender(s) per stage; "
             f"links ({links}): intra-node {intra_gbps:g} GB/s, inter-node {inter_gbps:g} GB/s"]
    for p in predictions:
        ratio = max(r / s for r, s in zip(p.engine_rank_bytes, p.engine_shard_bytes) if s)
        lines.append(f"[{p.transport}] predicted {p.seconds:.2f} s; per engine rank received "
                     f"{max(p.engine_rank_bytes) / GB:.2f} GB (max), shard {max(p.engine_shard_bytes) / GB:.2f} GB, "
                     f"received/shard {ratio:.2f}")
        lines.extend(_engine_node_lines(p, inter_gbps))
        lines.append("  stage  replica  sender  engines  stage_GB  gather_intra_GB  gather_inter_GB  "
                     "sender_link_GB  seconds")
        for s in p.stages:
            lines.append(f"  {s.pp_rank:5d}  {s.replica:7d}  {s.sender_rank:6d}  {s.engines:7d}  {s.hf_bytes / GB:8.2f}"
                         f"  {s.gather_intra_bytes / GB:15.2f}  {s.gather_inter_bytes / GB:15.2f}"
                         f"  {s.send_bytes / GB:14.2f}  {s.seconds:7.2f}")
    return "\n".join(lines)


def _engine_node_lines(p: SyncPrediction, inter_gbps: float) -> list[str]:
    """An engine over several nodes: what each of its nodes receives, over its own GPUs' network
    links (each engine rank has its own; a lower bound per node, not added to the stage times,
    which the senders' links bound)."""
    nodes = max(p.engine_rank_node, default=0) + 1
    if nodes == 1:
        return []
    out = [f"  each engine spans {nodes} nodes; per engine node: ranks, received_GB, receive_s over its links"]
    for node in range(nodes):
        ranks = [r for r, n in enumerate(p.engine_rank_node) if n == node]
        got = sum(p.engine_rank_bytes[r] for r in ranks)
        out.append(f"    node {node}: ranks {ranks[0]}-{ranks[-1]}, {got / GB:.2f} GB, "
                   f"{max(p.engine_rank_bytes[r] for r in ranks) / GB / inter_gbps:.2f} s")
    return out


def plan_from_config(cfg, *, senders: str | None = None):
    """The sync plan of a resolved run config (metadata only: ``model.hf_path``'s ``config.json``);
    ``senders="owner"``: the owner senders' plan (one sender per stage, each layer's experts spread:
    ``build_plan``'s ``spread_experts``, as :func:`~megarl.weight_sync.synchronizer_build.build_weight_sync`
    builds it), else the configured senders' (``auto``: segment senders, the ``[p2p]`` block)."""
    from megarl.config.device import resolved_precision
    from megarl.models.fp8_blocks import parse_quantization_config
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.synchronizer_build import senders_per_stage

    p, cl, engine = cfg.parallel, cfg.cluster, cfg.rollout.engine
    auto = "segment" if cfg.weight_sync.senders == "auto" else None  # [p2p] as configured; owner splits copies itself
    auto = "owner" if senders == "owner" else auto
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[resolved_precision(cfg)]
    trainer = TrainerLayout.from_world_size(
        int(cl.trainer_nodes) * int(cl.trainer_devices_per_node),
        tensor_model_parallel_size=int(p.tensor_model_parallel_size),
        pipeline_model_parallel_size=int(p.pipeline_model_parallel_size),
        expert_model_parallel_size=int(p.expert_model_parallel_size),
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=int(p.context_parallel_size),
        num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage)
    hf_config = load_hf_config(str(cfg.model.hf_path))
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=trainer.tp_size,
                                       make_vocab_size_divisible_by=int(cfg.model.make_vocab_size_divisible_by),
                                       dtype=dtype)
    engines = EngineLayout(tensor_parallel_size=int(engine.tensor_parallel_size),
                           expert_parallel_size=int(engine.expert_parallel_size),
                           num_engines=int(cfg.rollout.num_engines))
    return build_plan(trainer, engines, specs, bucket_size_mb=cfg.weight_sync.bucket_size_mb,
                      quantization=parse_quantization_config(  # on paper: no SGLang version guard
                          getattr(hf_config, "quantization_config", None),
                          where=f"{cfg.model.hf_path}/config.json quantization_config"),
                      senders_per_stage=senders_per_stage(cfg.weight_sync, auto), spread_experts=senders == "owner")


def placement_from_config(cfg):
    """The conversion's copy instructions for a resolved run config (metadata only)."""
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.model_specs import engine_table

    hf_config = load_hf_config(str(cfg.model.hf_path))
    family = get_family(hf_config)
    return Placement(family.layout(
        hf_config, make_vocab_size_divisible_by=int(cfg.model.make_vocab_size_divisible_by),
        tp_size=int(cfg.parallel.tensor_model_parallel_size)), engine_table(family, hf_config),
        engine_tp_size=int(cfg.rollout.engine.tensor_parallel_size))


def predict_from_config(cfg, *, intra_gbps: float, inter_gbps: float) -> tuple[WeightSyncPlan, list[SyncPrediction]]:
    """The sync plan of a resolved run config and its p2p / distributed predictions (module docstring)."""
    plan = plan_from_config(cfg)
    placement = placement_from_config(cfg) if senders_on_paper(cfg) != "stage" else None  # owner: segment beside
    predictions = [predict_sync(plan, t, ranks_per_node=int(cfg.cluster.trainer_devices_per_node),
                                intra_gbps=intra_gbps, inter_gbps=inter_gbps, placement=placement)
                   for t in ("p2p", "distributed")]
    tp, node = plan.engine_layout.tp_size, int(cfg.cluster.rollout_devices_per_node)
    spans = cfg.cluster.placement == "disaggregated" and tp > node  # whole nodes (megarl validate)
    per_node = node if spans else tp  # engine ranks per node (SGLang: node r runs r*tp/N ...)
    for p in predictions:
        p.engine_rank_node = [r // per_node for r in range(tp)]
    return plan, predictions


def link_speeds(cfg, *, gpu: str | None = None, intra_gbps: float | None = None,
                inter_gbps: float | None = None) -> tuple[float, float, str]:
    """``(intra_gbps, inter_gbps, source)``: the links of the ``cluster.gpu`` preset (``gpu`` names
    another; ``megarl.plan.gpus``, the presets ``megarl plan`` uses), each overridden by an explicit
    value; ``source`` says where they came from.

    Raises:
        UserError: a link is not given and no preset is named (``cluster.gpu`` / ``--gpu``) or found
            on this node; an unknown preset.
    """
    from megarl.errors import UserError
    from megarl.plan.gpus import detect_gpu, gpu_spec

    spec = None
    if intra_gbps is None or inter_gbps is None:
        try:
            spec = gpu_spec(gpu or cfg.cluster.gpu) or detect_gpu()
        except ValueError as e:
            raise UserError(str(e)) from None
        if spec is None:
            raise UserError("cluster.gpu: megarl plan-sync needs the links' speeds: set cluster.gpu (or pass --gpu: "
                            "h100, h200, b200, gb200), or pass both --intra-gbps and --inter-gbps")
    if spec is None:  # looked up unless both speeds are given
        assert intra_gbps is not None and inter_gbps is not None
        return intra_gbps, inter_gbps, "given"
    intra = intra_gbps if intra_gbps is not None else spec.nvlink_gbps
    inter = inter_gbps if inter_gbps is not None else spec.network_gbps
    overridden = intra_gbps is not None or inter_gbps is not None
    return intra, inter, f"GPU preset {spec.name}" + (", overridden" if overridden else "")


def sync_seconds(cfg, intra_gbps: float, inter_gbps: float) -> dict[str, float]:
    """``megarl plan``'s weight-sync seconds, ``{"p2p": s, "distributed": s}``, as ``megarl plan-sync``
    predicts them at these links: ``p2p`` is the sender path that runs
    (:func:`~megarl.weight_sync.choice.senders_on_paper`): with ``owner`` the owner senders' prediction
    as they run (:func:`~megarl.weight_sync.owner_predict.predict_owner_senders`), else the ``[p2p]``
    block's."""
    seconds = {p.transport: p.seconds for p in predict_from_config(cfg, intra_gbps=intra_gbps,
                                                                   inter_gbps=inter_gbps)[1]}
    if senders_on_paper(cfg) == "owner":
        seconds["p2p"] = predict_owner_senders(plan_from_config(cfg, senders="owner"), placement_from_config(cfg),
                                               inter_gbps=inter_gbps).seconds
    return seconds


def cmd_plan_sync(args, cfg) -> int:
    """``megarl plan-sync CONFIG [overrides] [--gpu G] [--intra-gbps X --inter-gbps Y]`` on a validated ``cfg``."""
    intra, inter, source = link_speeds(cfg, gpu=args.gpu, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps)
    plan, predictions = predict_from_config(cfg, intra_gbps=intra, inter_gbps=inter)
    owner_plan = plan_from_config(cfg, senders="owner")
    owners = predict_owner_senders(owner_plan, placement_from_config(cfg), inter_gbps=inter)
    text = format_prediction(plan, predictions, intra_gbps=intra, inter_gbps=inter, links=source).split("\n")
    print("\n".join([text[0], *format_owner_prediction(owner_plan, owners, inter_gbps=inter,
                                                        senders=senders_on_paper(cfg)), *text[1:]]))
    return 0


def add_plan_sync_parser(sub) -> None:
    """The ``plan-sync`` subcommand's arguments."""
    p = sub.add_parser("plan-sync", help="bytes per link / engine rank and predicted weight-sync time, on paper")
    p.add_argument("config", help="YAML run config (model.hf_path needs only config.json)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--gpu", default=None, help="GPU preset for the links (default: cluster.gpu, as megarl plan)")
    p.add_argument("--intra-gbps", type=float, default=None, help="NVLink GB/s per GPU (default: the GPU preset's)")
    p.add_argument("--inter-gbps", type=float, default=None, help="network GB/s per GPU (default: the GPU preset's)")
