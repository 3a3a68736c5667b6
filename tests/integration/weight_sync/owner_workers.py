"""Rank functions of the owner-sender tests (module-level: ``run_ranks`` spawns them)."""
from __future__ import annotations

import p2p_workers
import torch.distributed as dist
import workers

LAYOUTS = {
    "tp2_ep2_etp1": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
                     "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1,
                     "model.moe_token_dispatcher_type": "alltoall"},
    "tp2_dp2_ep4_etp1": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
                         "parallel.expert_model_parallel_size": 4, "parallel.expert_tensor_parallel_size": 1,
                         "model.moe_token_dispatcher_type": "alltoall"},
    "tp2_pp2_ep2_etp1": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
                         "parallel.pipeline_model_parallel_size": 2, "parallel.expert_model_parallel_size": 2,
                         "parallel.expert_tensor_parallel_size": 1, "model.moe_token_dispatcher_type": "alltoall"},
}
"""DeepSeek-V3's shape in small: experts spread over every rank (EP = world, ETP 1, one
expert-data-parallel copy), the dense layers TP2 (one dense copy on 2 ranks, two on 4); and with two pipeline
stages (both stages' ranks in one group with the engine ranks, delivering at once)."""


def owner_sync(rank: int, world_size: int, hf_dir: str, layout: str, urls: list[str], probes, engine_tp: int,
               train_sequences) -> dict | None:
    """Train two steps at ``LAYOUTS[layout]``, sync with the default ``weight_sync`` senders and
    transport (``auto``: owner senders over ``p2p`` here, the engine registered the receiver; load
    proof on), read the engine's and the trainer's probe logprobs and each rank's bytes sent; then
    train one more step and sync with one byte flipped in the first part one trainer rank sends
    to engine rank 1 of the first round's first bucket: the sync must fail naming it, nothing loaded.

    Returns (rank 0): ``{"trainer", "engine", "verify", "metrics", "sent", "planned", "error",
    "tampered", "after_corrupt", "resolved", "stage_buckets", ...}``.
    """
    import torch

    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.owners import OwnerParts
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    cfg = workers.make_cfg(hf_dir, LAYOUTS[layout])
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, engine_tp_size=engine_tp, dtype="float32")
    syncer = build_weight_sync(spec, trainer.parallel, WeightSyncConfig(bucket_size_mb=0.25), parallel_cfg=cfg.parallel)
    out: dict = {"resolved": (syncer.owner, syncer.transport_name),
                 "stage_buckets": [[b.index for b in syncer.plan.stage_buckets(pp)]
                                   for pp in sorted({b.pp_rank for b in syncer.plan.buckets})],
                 "rounds": [[b.index for b in r] for r in OwnerParts(syncer.plan, syncer.placement).rounds()]}
    try:
        if rank == 0:
            workers.reset_engines(urls, hf_dir)
        dist.barrier()
        out["trainer"] = workers.trainer_probe_logprobs(trainer, probes)
        out["metrics"] = syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
        out["verify"] = syncer.verify(probes, [torch.tensor(t) for t in out["trainer"]], tolerance=1e-3)
        if rank == 0:
            out["engine"] = workers.engine_logprobs(urls, probes)
        sent = [None] * world_size
        dist.all_gather_object(sent, syncer.transport.stats.bytes_sent)
        parts = syncer.transport.parts
        out["sent"], out["planned"] = sent, [parts.sends.sent.get(r, 0) for r in range(world_size)]
        out["engine_shard_bytes"] = syncer.plan.engine_shard_bytes()
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=5)))
        bucket = syncer.transport.rounds[0][0]  # the first round's first bucket: nothing was loaded before it
        first = parts.parts(bucket, 0, 1)[0]  # engine rank 1's first part of it and its sender
        out["tampered"] = {"sender": first.sender, "tensor": parts.listings(bucket)[1][first.tensor][0],
                           "bucket": bucket.index}
        if rank == first.sender:
            syncer.transport.tamper = p2p_workers.flip_one_byte((bucket.index, 1), offset=3)
        try:
            syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
            out["error"] = None
        except WeightSyncError as err:
            out["error"] = str(err)
        syncer.transport.tamper = None
        if rank == 0:
            _release_engines(urls)
            out["after_corrupt"] = workers.engine_logprobs(urls, probes)
        dist.barrier()
        out.update(_abort_then_sync(rank, world_size, syncer, trainer, urls, probes, first.sender, bucket.index))
        if rank == 0:
            workers.reset_engines(urls, hf_dir)
        dist.barrier()
    finally:
        try:
            syncer.close()
        finally:
            destroy_parallel()
    return out if rank == 0 else None


def _release_engines(urls) -> None:
    """End the update session a failed sync left open and resume generation."""
    with p2p_workers.workers_engines(urls) as engines:
        engines.call_all("end_weight_update")
        engines.call_all("resume")


def _abort_then_sync(rank: int, world_size: int, syncer, trainer, urls, probes, failing: int, at: int) -> dict:
    """Trainer rank ``failing`` raises before its bytes of bucket ``at`` for engine rank 1 leave: every
    rank must raise (the others naming it), no engine may load anything, and the same groups must
    carry the next sync (engine = trainer again). Returns ``{"abort_errors", "after_abort",
    "engine_after", "trainer_after"}`` (the engine's on rank 0)."""
    from megarl.weight_sync.manifest_checks import WeightSyncError

    out: dict = {}
    if rank == failing:
        syncer.transport.tamper = p2p_workers.fail_at((at, 1))
    try:
        syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
        error = None
    except WeightSyncError as err:
        error = str(err)
    syncer.transport.tamper = None
    out["abort_errors"] = [None] * world_size
    dist.all_gather_object(out["abort_errors"], error)
    if rank == 0:
        _release_engines(urls)
        out["after_abort"] = workers.engine_logprobs(urls, probes)
    dist.barrier()
    syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
    out["trainer_after"] = workers.trainer_probe_logprobs(trainer, probes)
    if rank == 0:
        out["engine_after"] = workers.engine_logprobs(urls, probes)
    dist.barrier()
    return out
