"""Megatron DDP, optimizer and learning-rate schedule from the ``train`` / ``parallel`` config.

Everything here is Megatron-Core's own machinery: ``DistributedDataParallel`` (contiguous grad
buffers, gradient reduction over the data-parallel group and, for expert weights, over the expert
data-parallel group), ``get_megatron_optimizer`` (one optimizer for dense and one for expert
parameters, chained; optional distributed optimizer sharding the Adam state and fp32 main weights
over data-parallel ranks; gradient-norm clipping over all model-parallel ranks) and
``OptimizerParamScheduler`` (warm-up, then constant / linear / cosine decay).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.config.schema import TrainConfig


def freeze_router(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Stop gradient updates of every MoE router (``model.moe_router_freeze``).

    Must run before `build_ddp`: Megatron DDP only allocates gradient buffers for parameters that
    require gradients, so frozen routers also cost no gradient memory or communication.

    Returns:
        The number of frozen parameters.
    """
    from megatron.core.transformer.moe.router import Router

    frozen = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, Router):
                for param in module.parameters():
                    param.requires_grad_(False)
                    frozen += 1
    return frozen


def build_ddp(model_chunks: Sequence[torch.nn.Module], *, use_distributed_optimizer: bool,
              overrides: dict | None = None) -> list[torch.nn.Module]:
    """Wrap each model chunk in Megatron ``DistributedDataParallel``.

    Gradients are reduced in fp32 (``grad_reduce_in_fp32``) without overlap: one reduction after
    the last micro batch, by Megatron's ``finalize_model_grads``, which this function installs as
    the model config's ``finalize_model_grads_func``. Only the first chunk uses buckets, as in
    Megatron-LM (later virtual-pipeline chunks are reduced as one buffer).

    Args:
        model_chunks: this rank's ``GPTModel`` chunks (one per virtual pipeline stage).
        use_distributed_optimizer: ``parallel.use_distributed_optimizer``; the gradient buffers
            are then reduce-scattered instead of all-reduced.
        overrides: ``DistributedDataParallelConfig`` fields from ``model.megatron_overrides``,
            applied last.

    Returns:
        The wrapped chunks, in order.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
        "use_distributed_optimizer": use_distributed_optimizer, **(overrides or {})})
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=index > 0)
               for index, chunk in enumerate(model_chunks)]
    for chunk in model_chunks:
        # The schedules call this after the last micro batch: DP (and expert-DP) gradient
        # reduction, and the TP all-reduce of sequence-parallel norm weights. Without it every
        # rank would step on its own gradient.
        chunk.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(train_cfg: TrainConfig, ddp_chunks: Sequence[torch.nn.Module], *,
                    use_distributed_optimizer: bool):
    """Megatron optimizer (Adam(W) or SGD) with gradient clipping, matching the model's precision.

    Args:
        train_cfg: ``train`` section (``optimizer``, ``lr``, ``min_lr``, ``weight_decay``,
            ``adam_*``, ``clip_grad``).
        ddp_chunks: the DDP-wrapped model chunks.
        use_distributed_optimizer: shard optimizer state over data-parallel ranks.

    Returns:
        A ``megatron.core.optimizer.MegatronOptimizer`` (a ``ChainedOptimizer`` for MoE models).

    Raises:
        ValueError: on an unknown ``train.optimizer``, or fp16 (no loss scaling is wired up).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if train_cfg.optimizer not in ("adam", "sgd"):
        raise ValueError(f"train.optimizer must be 'adam' or 'sgd', got {train_cfg.optimizer!r}")
    model_config = ddp_chunks[0].config
    if model_config.fp16:
        raise ValueError("train.precision=fp16 is not supported (use bf16: no loss scaling is needed)")
    config = OptimizerConfig(
        optimizer=train_cfg.optimizer, lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        weight_decay=train_cfg.weight_decay, adam_beta1=train_cfg.adam_beta1,
        adam_beta2=train_cfg.adam_beta2, adam_eps=train_cfg.adam_eps,
        clip_grad=train_cfg.clip_grad, bf16=model_config.bf16, fp16=False,
        params_dtype=model_config.params_dtype, use_distributed_optimizer=use_distributed_optimizer)
    return get_megatron_optimizer(config, list(ddp_chunks))


def build_scheduler(train_cfg: TrainConfig, optimizer, *, total_steps: int):
    """Megatron ``OptimizerParamScheduler``: linear warm-up from 0, then ``train.lr_decay_style``.

    Args:
        train_cfg: ``train`` section (``lr``, ``min_lr``, ``lr_warmup_steps``, ``lr_decay_style``,
            ``weight_decay``).
        optimizer: the Megatron optimizer.
        total_steps: optimizer steps of the whole run (decay horizon), >= 1.

    Raises:
        ValueError: on an unknown ``train.lr_decay_style`` or a warm-up longer than the run.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if train_cfg.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"train.lr_decay_style must be constant, linear or cosine, got {train_cfg.lr_decay_style!r}")
    total_steps = max(int(total_steps), 1)
    if train_cfg.lr_warmup_steps > total_steps:
        raise ValueError(f"train.lr_warmup_steps={train_cfg.lr_warmup_steps} exceeds the run's "
                         f"{total_steps} optimizer steps")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        lr_warmup_steps=train_cfg.lr_warmup_steps, lr_decay_steps=total_steps,
        lr_decay_style=train_cfg.lr_decay_style, start_wd=train_cfg.weight_decay,
        end_wd=train_cfg.weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant")
