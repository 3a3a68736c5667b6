"""Rank functions of the ``p2p`` transport tests (module-level: ``run_ranks`` spawns them)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import workers


def flip_one_byte(target: tuple[int, int], offset: int):
    """A ``P2PTransport.tamper`` that sends a copy of bucket ``target[0]``'s bytes for engine rank
    ``target[1]`` with byte ``offset`` flipped (every other buffer goes untouched)."""
    def tamper(index: int, rank: int, buffer: torch.Tensor):
        if (index, rank) != target:
            return None
        bad = buffer.clone()
        bad[offset] ^= 0xFF
        return bad
    return tamper


def sync_then_corrupt(rank: int, world_size: int, hf_dir: str, layout: str, urls: list[str], probes,
                      engine_tp: int, workdir: str, train_sequences, corrupt: tuple[int, int] | None,
                      master_address: str = "127.0.0.1") -> dict | None:
    """Train two steps at ``layout``; reload the engines from disk and read their probe logprobs (the
    reference); sync with ``p2p`` and read them again; then train one more step and sync with one
    flipped byte in bucket ``corrupt[0]`` for engine rank ``corrupt[1]`` (skipped when None): the
    sync must fail naming the tensor and the engines must still answer as after the good sync.

    Returns (rank 0): ``{"disk", "p2p", "after_corrupt", "metrics", "error", "tensor_names"}``.
    """
    from megarl.config.schema import WeightSyncConfig
    from megarl.training.build import build_trainer
    from megarl.training.parallel_state import destroy_parallel
    from megarl.weight_sync.sync import build_weight_sync
    from megarl.weight_sync.validate import WeightSyncError

    cfg = workers.make_cfg(hf_dir, workers.LAYOUTS[layout])
    trainer = build_trainer(cfg)
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    out: dict = {}
    syncers = {}
    for transport in ("disk", "p2p"):
        syncers[transport] = build_weight_sync(
            hf_dir, trainer.parallel, urls, WeightSyncConfig(transport=transport, bucket_size_mb=0.25),
            engine_tp_size=engine_tp, dtype="float32", parallel_cfg=cfg.parallel, check_manifest=False,
            directory=os.path.join(workdir, f"disk-{layout}"), master_address=master_address)
    try:
        for transport in ("disk", "p2p"):
            if rank == 0:
                workers.reset_engines(urls, hf_dir)
            dist.barrier()
            out.setdefault("metrics", {})[transport] = syncers[transport].sync(
                dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
            if rank == 0:
                out[transport] = workers.engine_logprobs(urls, probes)
            dist.barrier()
        out["plan_shard_bytes"] = syncers["p2p"].plan.engine_shard_bytes()
        if corrupt is None:
            return out if rank == 0 else None
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=5)))
        p2p = syncers["p2p"]
        if p2p.transport is not None:
            p2p.transport.tamper = flip_one_byte(corrupt, offset=3)
            out["tensor_names"] = [t.name for b in p2p.plan.buckets if b.index == corrupt[0] for t in b.hf_tensors]
        try:
            p2p.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
            out["error"] = None
        except WeightSyncError as err:
            out["error"] = str(err)
        if rank == 0:
            with workers_engines(urls) as engines:  # the failed sync left them paused in a session
                engines.call_all("end_weight_update")
                engines.call_all("resume")
            out["after_corrupt"] = workers.engine_logprobs(urls, probes)
        dist.barrier()
    finally:
        for syncer in syncers.values():
            try:
                syncer.close()
            except Exception:  # noqa: BLE001 - the failed sync may have left its group unusable
                pass
        destroy_parallel()
    return out if rank == 0 else None


def workers_engines(urls):
    from megarl.weight_sync.engines import EngineGroup

    return EngineGroup(urls)


def across_layouts(rank: int, world_size: int, hf_dir: str, layouts: list[str], urls: list[str], probes,
                   engine_tp: int, workdir: str, train_sequences, corrupt_layout: str,
                   master_address: str) -> dict | None:
    """:func:`sync_then_corrupt` for each layout in one process pair (Megatron imported once); the
    flipped byte only at ``corrupt_layout``."""
    out = {}
    for layout in layouts:
        out[layout] = sync_then_corrupt(rank, world_size, hf_dir, layout, urls, probes, engine_tp,
                                        os.path.join(workdir, layout), train_sequences,
                                        (0, 1) if layout == corrupt_layout else None, master_address)
    return out if rank == 0 else None
