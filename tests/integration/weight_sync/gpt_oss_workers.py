"""Rank function of the gpt-oss transport test (module-level: ``run_ranks`` spawns it)."""
from __future__ import annotations

import owner_workers
import torch.distributed as dist
import workers


def every_transport(rank: int, world_size: int, hf_dir: str, urls: list[str], probes, workdir: str,
                    train_sequences) -> dict | None:
    """``workers.train_then_sync`` at trainer EP2 (gpt-oss's biased experts train at expert TP 1
    only: ``megarl.training`` refuses ETP 2) with every stage-sender transport (``distributed``
    checked by the receiver, ``disk``, ``shard``, ``tensor``, ``p2p`` with segment senders); then
    ``distributed`` as SGLang does it at EP2 again (the receiver hidden from
    ``choice.make_transport``, so its own ``/update_weights_from_distributed`` loads the flat
    bucket); then owner senders (``weight_sync`` defaults: ``auto`` resolves to owner + ``p2p``)
    at TP2 EP2 ETP1.

    Returns (rank 0): ``{"stage": train_then_sync's, "unchecked": its, "owner": {"resolved",
    "trainer", "engine"}}``.
    """
    from megarl.weight_sync import choice

    out = {"stage": workers.train_then_sync(rank, world_size, hf_dir, ["ep2"],
                                            ["distributed", "disk", "shard", "tensor", "p2p"], urls, probes, 1,
                                            workdir, train_sequences)}
    has_receiver = choice.engines_have_receiver
    choice.engines_have_receiver = lambda *args, **kwargs: False
    try:
        out["unchecked"] = workers.train_then_sync(rank, world_size, hf_dir, ["ep2"], ["distributed"], urls, probes,
                                                   1, workdir, train_sequences)
    finally:
        choice.engines_have_receiver = has_receiver
    out["owner"] = _owner_sync(rank, hf_dir, urls, probes, train_sequences)
    return out if rank == 0 else None


def _owner_sync(rank: int, hf_dir: str, urls, probes, train_sequences) -> dict:
    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    cfg = workers.make_cfg(hf_dir, owner_workers.LAYOUTS["tp2_ep2_etp1"])
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, dtype="float32")
    syncer = build_weight_sync(spec, trainer.parallel, WeightSyncConfig(bucket_size_mb=0.25), parallel_cfg=cfg.parallel)
    out: dict = {"resolved": (syncer.owner, syncer.transport_name)}
    try:
        if rank == 0:
            workers.reset_engines(urls, hf_dir)
        dist.barrier()
        out["trainer"] = workers.trainer_probe_logprobs(trainer, probes)
        syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
        if rank == 0:
            out["engine"] = workers.engine_logprobs(urls, probes)
            workers.reset_engines(urls, hf_dir)
        dist.barrier()
    finally:
        try:
            syncer.close()
        finally:
            destroy_parallel()
    return out
