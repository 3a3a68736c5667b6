"""Rank functions of the ``p2p`` transport tests (module-level: ``run_ranks`` spawns them)."""
from __future__ import annotations

import faulthandler
import os
import sys

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

    Raises:
        RuntimeError: closing a synchronizer's groups failed (e.g. the stage senders' concurrent
            close at PP2); raised after every synchronizer was closed, unless another error is
            already propagating (then printed to stderr and the first error kept).
    """
    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    cfg = workers.make_cfg(hf_dir, {**workers.LAYOUTS, **workers.LAYOUTS_4}[layout])
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    syncers = {}
    for transport in ("disk", "p2p"):
        spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, engine_tp_size=engine_tp, dtype="float32",
                        check_manifest=False, directory=os.path.join(workdir, f"disk-{layout}"),
                        master_address=master_address)
        syncers[transport] = build_weight_sync(
            spec, trainer.parallel, WeightSyncConfig(transport=transport, senders="segment", bucket_size_mb=0.25), parallel_cfg=cfg.parallel)
    try:
        out = _syncs(rank, trainer, syncers, urls, hf_dir, probes, train_sequences, corrupt)
    except BaseException:
        try:
            errors = _close(syncers)
            if errors:
                print(f"rank {rank} at {layout}: closing after an error also failed: {errors}", file=sys.stderr)
        finally:
            destroy_parallel()
        raise
    try:
        errors = _close(syncers)
    finally:
        destroy_parallel()
    if errors:
        raise RuntimeError(f"rank {rank} at {layout}: closing the weight-sync groups failed: {errors}")
    return out if rank == 0 else None


def _close(syncers: dict) -> list[str]:
    """Close every synchronizer; the errors, one line each (none swallowed: the caller raises them)."""
    errors = []
    for name, syncer in syncers.items():
        try:
            syncer.close()
        except Exception as err:  # noqa: BLE001 - collected so that every synchronizer is closed
            errors.append(f"{name}: {type(err).__name__}: {err}")
    return errors


def _syncs(rank, trainer, syncers, urls, hf_dir, probes, train_sequences, corrupt) -> dict:
    """The syncs of :func:`sync_then_corrupt` (every rank; the engine answers on rank 0)."""
    from megarl.weight_sync.manifest_checks import WeightSyncError

    out: dict = {}
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
    p2p = syncers["p2p"]  # which trainer ranks sent bytes to the engines, per stage
    sent = (p2p.stage, rank, p2p.transport is not None and p2p.transport.stats.bytes_sent > 0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sent)
    out["senders"] = [sorted(r for s, r, did in everyone if s == stage and did)
                      for stage in sorted({s for s, _, _ in everyone if s is not None})]
    if corrupt is None:
        return out
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
    # The sender fails mid-bucket (engine rank 0 has bucket 0's bytes, rank 1 not yet): abort()
    # must release the receivers, nothing may load, and the group must carry the next sync.
    if p2p.transport is not None:
        p2p.transport.tamper = fail_at(corrupt)
    try:
        p2p.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
        out["abort_error"] = None
    except WeightSyncError as err:
        out["abort_error"] = str(err)
    if p2p.transport is not None:
        p2p.transport.tamper = None
    out["abort_errors"] = [None] * dist.get_world_size()  # every rank's: the failing sender's own error is among them
    dist.all_gather_object(out["abort_errors"], out["abort_error"])
    if rank == 0:
        with workers_engines(urls) as engines:
            engines.call_all("end_weight_update")
            engines.call_all("resume")
        out["after_abort"] = workers.engine_logprobs(urls, probes)
        workers.reset_engines(urls, hf_dir)
    dist.barrier()
    syncers["disk"].sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
    if rank == 0:
        out["disk_after"] = workers.engine_logprobs(urls, probes)
        workers.reset_engines(urls, hf_dir)
    dist.barrier()
    out["metrics_after_abort"] = p2p.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
    if rank == 0:
        out["p2p_after"] = workers.engine_logprobs(urls, probes)
    dist.barrier()
    return out


def fail_at(target: tuple[int, int]):
    """A ``P2PTransport.tamper`` that raises (a sender-side failure) before bucket ``target[0]``'s
    bytes for engine rank ``target[1]`` leave; the ranks before it got theirs."""
    from megarl.weight_sync.manifest_checks import WeightSyncError

    def tamper(index: int, rank: int, buffer: torch.Tensor):
        if (index, rank) == target:
            raise WeightSyncError(f"injected sender failure at bucket {index} rank {rank}")
        return None
    return tamper


def workers_engines(urls):
    from megarl.weight_sync.engine_clients import EngineClients

    return EngineClients(urls)


def capture_rank_output(log_dir: str, rank: int, dump_every_s: float):
    """Send this rank's stdout and stderr (file descriptors 1 and 2: C++ and gloo output too) to
    ``{log_dir}/rank{rank}.log`` and dump every thread's stack there every ``dump_every_s`` seconds
    (and on a fatal signal), so that a hang says where. Returns the open log file."""
    os.makedirs(log_dir, exist_ok=True)
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "a", buffering=1, encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.dump_traceback_later(dump_every_s, repeat=True, file=log)
    return log


def across_layouts(rank: int, world_size: int, hf_dir: str, layouts: list[str], urls: list[str], probes,
                   engine_tp: int, workdir: str, train_sequences, corrupt_layout: str,
                   master_address: str, dump_every_s: float = 300.0) -> dict | None:
    """:func:`sync_then_corrupt` for each layout in one process pair (Megatron imported once); the
    flipped byte only at ``corrupt_layout``. This rank's output goes to ``{workdir}/logs/rank{rank}.log``
    (:func:`capture_rank_output`)."""
    log = capture_rank_output(os.path.join(workdir, "logs"), rank, dump_every_s)
    try:
        out = {}
        for layout in layouts:
            print(f"rank {rank}: layout {layout}", flush=True)
            out[layout] = sync_then_corrupt(rank, world_size, hf_dir, layout, urls, probes, engine_tp,
                                            os.path.join(workdir, layout), train_sequences,
                                            (0, 1) if layout == corrupt_layout else None, master_address)
        return out if rank == 0 else None
    finally:
        faulthandler.cancel_dump_traceback_later()
        log.flush()
