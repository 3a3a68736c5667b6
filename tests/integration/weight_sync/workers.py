"""Rank functions for the weight-sync integration tests (module-level: ``run_ranks`` spawns them)."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

LAYOUTS = {
    "tp2": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True},
    "ep2": {"parallel.expert_model_parallel_size": 2, "model.moe_token_dispatcher_type": "alltoall"},
    "pp2": {"parallel.pipeline_model_parallel_size": 2},
    "dp2": {},
}
"""World-size-2 trainer layouts, as ``section.key`` overrides."""
LAYOUTS_4 = {
    "tp2pp2": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
               "parallel.pipeline_model_parallel_size": 2},
}
"""World-size-4 trainer layouts."""


def make_cfg(hf_dir: str, overrides: dict):
    """A small CPU training config for the tiny model (fp32, a large LR so two steps move the policy)."""
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    cfg.model.hf_path = str(hf_dir)
    cfg.cluster.device = "cpu"
    cfg.train.precision = "fp32"
    cfg.train.lr = 1e-2
    cfg.train.max_tokens_per_microbatch = 64
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def packed(sequences: list[list[int]], *, train: bool, seed: int = 0):
    """A `TrainBatch` of ``sequences`` (every token after the first trained when ``train``)."""
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([len(s) for s in sequences])
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    mask = torch.ones(int(cu[-1]), dtype=torch.bool) if train else torch.zeros(int(cu[-1]), dtype=torch.bool)
    mask[cu[:-1]] = False
    return TrainBatch(input_ids=torch.tensor([t for s in sequences for t in s], dtype=torch.int64), cu_seqlens=cu,
                      loss_mask=mask, advantages=torch.randn(len(sequences), generator=gen),
                      rollout_logprobs=torch.zeros(int(cu[-1])))


def trainer_probe_logprobs(trainer, probes: list[list[int]]) -> list[list[float]]:
    """The trainer's own logprobs of tokens 1..P-1 of each probe."""
    batch = packed(probes, train=False)
    flat = trainer.compute_logprobs(batch).double()
    cu = batch.cu_seqlens.tolist()
    return [flat[cu[i] + 1:cu[i + 1]].tolist() for i in range(len(probes))]


def engine_logprobs(urls, probes) -> list[list[list[float]]]:
    """``[engine][probe]`` teacher-forced logprobs of tokens 1..P-1."""
    from megarl.weight_sync.engine_clients import EngineClients
    from megarl.weight_sync.verify import engine_prompt_logprobs

    with EngineClients(urls) as engines:
        return [[t.tolist() for t in per_engine] for per_engine in engine_prompt_logprobs(engines, probes)]


def reset_engines(urls, model_dir: str) -> None:
    """Reload the engines' original weights from disk (the reference transport)."""
    from megarl.weight_sync.engine_clients import EngineClients

    with EngineClients(urls) as engines:
        engines.call_all("update_weights_from_disk", model_dir)


def train_then_sync(rank: int, world_size: int, hf_dir: str, layouts: list[str], transports: list[str],
                    urls: list[str], probes: list[list[int]], engine_tp: int, workdir: str,
                    train_sequences: list[list[int]]) -> dict | None:
    """Per layout: build the trainer from ``hf_dir``, take two GSPO steps, then for each transport
    reset the engines to ``hf_dir``, sync, and read the engines' probe logprobs (rank 0 reads).

    Returns (rank 0): ``{layout: {"trainer": [...], "before": {t: ...}, "after": {t: ...},
    "metrics": {t: {...}}}}``.
    """
    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    results = {}
    for layout in layouts:
        cfg = make_cfg(hf_dir, LAYOUTS[layout])
        trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
        for step in range(2):
            trainer.train_step(trainer.prepare_batch(packed(train_sequences, train=True, seed=step)))
        out = {"trainer": trainer_probe_logprobs(trainer, probes), "before": {}, "after": {}, "metrics": {},
               "verify": {}, "stale_detected": {}}
        params = dict(trainer.named_parameters_for_sync())
        trainer_logprobs = [torch.tensor(t) for t in out["trainer"]]
        for transport in transports:
            ws_cfg = WeightSyncConfig(transport=transport, senders="segment", bucket_size_mb=0.25)  # owner: test_owner_sync.py
            spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, engine_tp_size=engine_tp, dtype="float32",
                            directory=os.path.join(workdir, f"disk-{layout}"))
            syncer = build_weight_sync(spec, trainer.parallel, ws_cfg, parallel_cfg=cfg.parallel)
            try:
                if rank == 0:
                    reset_engines(urls, hf_dir)
                    out["before"][transport] = engine_logprobs(urls, probes)
                dist.barrier()
                try:  # the engines still serve the old policy: verification must fail on every rank
                    syncer.verify(probes, trainer_logprobs, tolerance=1e-3)
                    out["stale_detected"][transport] = False
                except WeightSyncError:
                    out["stale_detected"][transport] = True
                out["metrics"][transport] = syncer.sync(params, policy_version=trainer.step)
                out["verify"][transport] = syncer.verify(probes, trainer_logprobs, tolerance=1e-3)
            finally:
                syncer.close()
            if rank == 0:
                out["after"][transport] = engine_logprobs(urls, probes)
            dist.barrier()
        results[layout] = out
        del trainer, params
        gc.collect()
        destroy_parallel()
    if rank == 0:
        reset_engines(urls, hf_dir)  # leave the shared engine as the other tests expect it
    return results if rank == 0 else None
