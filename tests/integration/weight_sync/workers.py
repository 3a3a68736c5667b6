"""Rank functions for the weight-sync integration tests (module-level: ``run_ranks`` spawns them)."""
from __future__ import annotations

import os

import torch


def build_policy(hf_dir: str, parallel: dict):
    """This rank's Megatron policy at layout ``parallel``, loaded from ``hf_dir`` (fp32, CPU)."""
    from megarl.checkpoint import load_hf_weights
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    parallel_cfg = ParallelConfig(**parallel)
    state = initialize_parallel(parallel_cfg, backend="gloo")
    model_cfg = ModelConfig(hf_path=hf_dir, moe_token_dispatcher_type="alltoall")
    chunks = build_model(hf_dir, parallel_cfg, model_cfg, precision="fp32", device="cpu")
    load_hf_weights(chunks, hf_dir, state)
    return state, parallel_cfg, chunks


def local_params(chunks, state) -> dict[str, torch.Tensor]:
    from megarl.training.sync_names import named_parameters_for_sync

    return {name: p.detach() for name, p in named_parameters_for_sync(chunks, state)}


def engine_logprobs(urls, probes) -> list[list[list[float]]]:
    from megarl.weight_sync.engines import EngineGroup
    from megarl.weight_sync.verify import engine_prompt_logprobs

    with EngineGroup(urls) as engines:
        return [[t.tolist() for t in per_engine] for per_engine in engine_prompt_logprobs(engines, probes)]


def reset_engines(urls, model_dir: str) -> None:
    """Reload the engines' original weights from disk (the reference transport)."""
    from megarl.weight_sync.engines import EngineGroup

    with EngineGroup(urls) as engines:
        engines.call_all("update_weights_from_disk", model_dir)


def sync_transports(rank: int, world_size: int, trained_dir: str, engine_dir: str, parallel: dict,
                    transports: list, urls: list, probes: list, engine_tp: int, workdir: str) -> dict:
    """Load ``trained_dir`` into Megatron at ``parallel``; for each transport: sync, then (rank 0)
    read the engines' probe logprobs. Returns rank 0's measurements."""
    from megarl.config.schema import WeightSyncConfig
    from megarl.weight_sync.sync import build_weight_sync

    state, parallel_cfg, chunks = build_policy(trained_dir, parallel)
    params = local_params(chunks, state)
    out = {"before": engine_logprobs(urls, probes) if rank == 0 else None, "after": {}, "metrics": {}, "reset": {}}
    for i, transport in enumerate(transports):
        if rank == 0 and i > 0:  # every transport starts from the engine's original weights
            reset_engines(urls, engine_dir)
            out["reset"][transport] = engine_logprobs(urls, probes)
        torch.distributed.barrier()
        cfg = WeightSyncConfig(transport=transport, bucket_size_mb=0.25)
        syncer = build_weight_sync(engine_dir, state, urls, cfg, engine_tp_size=engine_tp, dtype="float32",
                                   parallel_cfg=parallel_cfg, directory=os.path.join(workdir, "disk"))
        try:
            metrics = syncer.sync(params, policy_version=i + 1)
        finally:
            syncer.close()
        if rank == 0:
            out["after"][transport] = engine_logprobs(urls, probes)
            out["metrics"][transport] = metrics
    return out if rank == 0 else None
