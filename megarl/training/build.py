"""Build a `Trainer` from a `MegarlConfig`, one small step per function (STYLE.md).

``build_trainer(cfg)`` = parallel state -> model chunks (HF ``config.json`` -> ``GPTModel``,
Transformer Engine spec on GPU, local spec on CPU) -> HF weights -> DDP -> optimizer -> LR
schedule -> `Trainer`. Each step is usable alone (tests, benchmarks, converters).
"""
from __future__ import annotations

import torch

from megarl.config.schema import MegarlConfig
from megarl.training.parallel_state import ParallelState


def resolve_precision(cfg: MegarlConfig) -> str:
    """``train.precision`` with ``auto`` resolved: bf16 on CUDA, fp32 on CPU (Megatron's CPU path)."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    cuda = torch.cuda.is_available() and cfg.cluster.device != "cpu"
    return "bf16" if cuda else "fp32"


def build_parallel_state(cfg: MegarlConfig) -> ParallelState:
    """Initialise Megatron's model-parallel groups (and ``torch.distributed`` from the environment
    if needed), seeded with ``train.seed``."""
    from megarl.training.parallel_state import initialize_parallel

    return initialize_parallel(cfg.parallel, backend="auto", seed=cfg.train.seed,
                               timeout_minutes=int(cfg.cluster.distributed_timeout_minutes))


def build_model_chunks(cfg: MegarlConfig, parallel: ParallelState) -> tuple[list, object]:
    """This rank's ``GPTModel`` chunks, with the weights of ``model.load_dir`` (a Megatron dist
    checkpoint) when set, else the HF weights when ``model.load_weights``.

    Returns:
        ``(chunks, hf_config)``.

    Raises:
        ValueError: from the model builder (architecture / parallel mismatches) or FP8 settings.
    """
    from megarl.checkpoint import load_hf_weights
    from megarl.training.fp8 import fp8_config
    from megarl.training.model import build_model, load_hf_config

    hf_config = load_hf_config(cfg.model.hf_path)
    cuda = torch.cuda.is_available() and cfg.cluster.device != "cpu"
    is_moe = bool(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
                  or getattr(hf_config, "n_routed_experts", None))
    extra = fp8_config(cfg.train, is_moe=is_moe, cuda=cuda)
    chunks = build_model(hf_config, cfg.parallel, cfg.model, precision=resolve_precision(cfg),
                         device="cuda" if cuda else "cpu", extra_config=extra or None)
    load_dir = cfg.model.get("load_dir") if hasattr(cfg.model, "get") else cfg.model.load_dir
    if load_dir:  # a Megatron checkpoint (megarl.checkpoint.load_dir), before DDP copies the params
        from megarl.checkpoint.load_dir import load_megatron_weights

        load_megatron_weights(chunks, load_dir)
    elif cfg.model.load_weights:
        load_hf_weights(chunks, cfg.model.hf_path, parallel)
    return chunks, hf_config


def optimizer_steps_per_rl_step(cfg: MegarlConfig) -> int:
    """Optimizer steps one RL step makes: trajectories per step / ``train.global_batch_size``."""
    trajectories = cfg.rollout.num_prompts_per_step * cfg.rollout.group_size
    return max(-(-trajectories // cfg.train.global_batch_size), 1)


def build_trainer(cfg: MegarlConfig, *, parallel: ParallelState | None = None):
    """The whole trainer of this rank.

    Args:
        cfg: the run config (a `MegarlConfig` or the equivalent OmegaConf object).
        parallel: an already initialised parallel state (None: initialise it here).

    Returns:
        `megarl.training.trainer.Trainer`.
    """
    from megarl.training.model import split_megatron_overrides
    from megarl.training.optimizer import build_ddp, build_optimizer, build_scheduler
    from megarl.training.trainer import Trainer

    parallel = parallel or build_parallel_state(cfg)
    chunks, hf_config = build_model_chunks(cfg, parallel)
    use_dist_opt = cfg.parallel.use_distributed_optimizer
    _, ddp_overrides = split_megatron_overrides(dict(getattr(cfg.model, "megatron_overrides", None) or {}))
    cuda = torch.cuda.is_available() and cfg.cluster.device != "cpu"
    # GPU: overlap gradient reduction and (distributed optimizer) parameter all-gather, as Megatron-LM runs.
    ddp_chunks = build_ddp(chunks, use_distributed_optimizer=use_dist_opt, overrides=ddp_overrides, overlap=cuda)
    optimizer = build_optimizer(cfg.train, ddp_chunks, use_distributed_optimizer=use_dist_opt)
    scheduler = build_scheduler(cfg.train, optimizer,
                                total_steps=cfg.train.num_steps * optimizer_steps_per_rl_step(cfg))
    return Trainer(cfg, parallel=parallel, model_chunks=ddp_chunks, optimizer=optimizer, scheduler=scheduler,
                   hf_config=hf_config)
