"""Build a `Trainer` from a `MegarlConfig`, one small step per function (STYLE.md).

``build_trainer(cfg, load_weights=...)`` = parallel state -> model chunks (HF ``config.json`` ->
``GPTModel``, Transformer Engine spec on GPU, local spec on CPU) -> initial weights (the caller's
loader: `megarl.conversion.initial_weights.initial_weights` reads ``model.load_dir`` or the HF
weights) -> DDP -> optimizer -> LR schedule -> `Trainer`. Each step is usable alone (tests,
benchmarks, converters).
"""
from __future__ import annotations

from collections.abc import Callable

from megarl.config.device import resolved_precision, use_cuda
from megarl.config.model_rules import num_experts_of
from megarl.config.schema import MegarlConfig
from megarl.training.parallel_state import ParallelState

WeightLoader = Callable[[list, ParallelState], object]
"""``loader(model_chunks, parallel)``: fills this rank's freshly built ``GPTModel`` chunks in place
(before DDP copies the parameters); the return value is ignored."""


def build_parallel_state(cfg: MegarlConfig) -> ParallelState:
    """Initialise Megatron's model-parallel groups (and ``torch.distributed`` from the environment
    if needed), seeded with ``train.seed``."""
    from megarl.training.parallel_state import initialize_parallel

    return initialize_parallel(cfg.parallel, backend="auto", seed=cfg.train.seed,
                               timeout_minutes=int(cfg.cluster.distributed_timeout_minutes))


def build_model_chunks(cfg: MegarlConfig, parallel: ParallelState, *,
                       load_weights: WeightLoader | None) -> tuple[list, object]:
    """This rank's ``GPTModel`` chunks, filled by ``load_weights`` (None: randomly initialised).

    Args:
        cfg: the run config.
        parallel: this rank's initialised parallel state.
        load_weights: the initial weights' loader (`megarl.conversion.initial_weights.initial_weights`).

    Returns:
        ``(chunks, hf_config)``.

    Raises:
        ValueError: from the model builder (architecture / parallel mismatches) or FP8 settings.
        Whatever ``load_weights`` raises (missing or mismatched checkpoint files).
    """
    from megarl.training.fp8 import fp8_config
    from megarl.training.model import build_model, load_hf_config

    hf_config = load_hf_config(cfg.model.hf_path)
    cuda = use_cuda(cfg.cluster.device)
    is_moe = num_experts_of(hf_config) > 0
    extra = fp8_config(cfg.train, is_moe=is_moe, cuda=cuda)
    chunks = build_model(hf_config, cfg.parallel, cfg.model, precision=resolved_precision(cfg),
                         device="cuda" if cuda else "cpu", extra_config=extra or None)
    if load_weights is not None:  # before DDP copies the params
        load_weights(chunks, parallel)
    return chunks, hf_config


def optimizer_steps_per_rl_step(cfg: MegarlConfig) -> int:
    """Optimizer steps one RL step makes: trajectories per step / ``train.global_batch_size``."""
    trajectories = cfg.rollout.num_prompts_per_step * cfg.rollout.group_size
    return max(-(-trajectories // cfg.train.global_batch_size), 1)


def build_trainer(cfg: MegarlConfig, *, load_weights: WeightLoader | None, parallel: ParallelState | None = None):
    """The whole trainer of this rank.

    Args:
        cfg: the run config (a `MegarlConfig` or the equivalent OmegaConf object).
        load_weights: fills the model chunks before DDP wraps them: the run's initial weights are
            ``megarl.conversion.initial_weights.initial_weights(cfg.model)``; None: random weights.
        parallel: an already initialised parallel state (None: initialise it here).

    Returns:
        `megarl.training.trainer.Trainer`.
    """
    from megarl.training.model import split_megatron_overrides
    from megarl.training.optimizer import build_ddp, build_optimizer, build_scheduler
    from megarl.training.trainer import Trainer

    parallel = parallel or build_parallel_state(cfg)
    chunks, hf_config = build_model_chunks(cfg, parallel, load_weights=load_weights)
    use_dist_opt = cfg.parallel.use_distributed_optimizer
    _, ddp_overrides = split_megatron_overrides(dict(cfg.model.megatron_overrides or {}))
    cuda = use_cuda(cfg.cluster.device)
    # GPU: overlap gradient reduction and (distributed optimizer) parameter all-gather, as Megatron-LM runs.
    ddp_chunks = build_ddp(chunks, use_distributed_optimizer=use_dist_opt, overrides=ddp_overrides, overlap=cuda)
    optimizer = build_optimizer(cfg.train, ddp_chunks, use_distributed_optimizer=use_dist_opt)
    scheduler = build_scheduler(cfg.train, optimizer,
                                total_steps=cfg.train.num_steps * optimizer_steps_per_rl_step(cfg))
    return Trainer(cfg, parallel=parallel, model_chunks=ddp_chunks, optimizer=optimizer, scheduler=scheduler,
                   hf_config=hf_config)
