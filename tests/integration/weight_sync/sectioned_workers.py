"""Rank function of the engine-TP2 Qwen3.5 sync test (module-level: ``run_ranks`` spawns it)."""
from __future__ import annotations

import torch.distributed as dist
import workers

LAYOUT = {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
          "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1,
          "model.moe_token_dispatcher_type": "alltoall"}
"""Trainer TP2 x EP2 (expert TP 1): each trainer rank holds half of every DeltaNet section."""
PATHS = (("p2p", "owner"), ("p2p", "segment"), ("shard", "segment"), ("distributed", "segment"))
"""``(weight_sync.transport, weight_sync.senders)`` tried in turn: pre-sharded (each engine rank its
section blocks) from every trainer rank, from a segment's assembler, over shared memory; and whole
tensors into SGLang's own loaders (the path engine TP > 1 had before)."""


def sync_every_path(rank: int, world_size: int, hf_dir: str, urls: list[str], probes, train_sequences) -> dict | None:
    """Train two steps, then for each of :data:`PATHS`: reload the engine's original weights from
    disk, sync (load proof on every sync), read the engine's probe logprobs and the sync's metrics.

    Returns (rank 0): ``{"trainer": [[lp]], "paths": {"transport/senders": {"engine", "metrics",
    "error"}}}``.
    """
    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    cfg = workers.make_cfg(hf_dir, LAYOUT)
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    out: dict = {"trainer": workers.trainer_probe_logprobs(trainer, probes), "paths": {}}
    spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, engine_tp_size=2, dtype="float32")
    try:
        for transport, senders in PATHS:
            if rank == 0:
                workers.reset_engines(urls, hf_dir)
            dist.barrier()
            ws_cfg = WeightSyncConfig(transport=transport, senders=senders, bucket_size_mb=0.25,
                                      load_proof="every_sync")
            syncer = build_weight_sync(spec, trainer.parallel, ws_cfg, parallel_cfg=cfg.parallel)
            got: dict = {"error": None}
            try:
                got["metrics"] = syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
            except WeightSyncError as err:
                got["error"] = str(err)
            finally:
                syncer.close()
            if rank == 0:
                got["engine"] = workers.engine_logprobs(urls, probes)[0]
            out["paths"][f"{transport}/{senders}"] = got
            dist.barrier()
        if rank == 0:
            workers.reset_engines(urls, hf_dir)  # leave the engine as it started
    finally:
        destroy_parallel()
    return out if rank == 0 else None
