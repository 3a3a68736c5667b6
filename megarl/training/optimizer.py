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
from typing import Any

import torch

from megarl.config.schema import TrainConfig


def build_ddp(model_chunks: Sequence[torch.nn.Module], *, use_distributed_optimizer: bool,
              overrides: dict | None = None, overlap: bool = False) -> list[torch.nn.Module]:
    """Wrap each model chunk in Megatron ``DistributedDataParallel``.

    Gradients are reduced in fp32 (``grad_reduce_in_fp32``) by Megatron's ``finalize_model_grads``,
    which this function installs as the model config's ``finalize_model_grads_func``. Only the
    first chunk uses buckets, as in Megatron-LM (later virtual-pipeline chunks are reduced as one
    buffer).

    With ``overlap`` (megarl's GPU default) the hooks are wired as Megatron-LM's ``training.py``
    does: ``overlap_grad_reduce`` reduces each bucket as soon as its gradients of the last micro
    batch are ready (``config.no_sync_func`` = the chunks' ``no_sync`` holds the reduction off
    during the earlier micro batches; ``grad_sync_func`` = ``start_grad_sync``, Megatron-LM's
    ``--align-grad-reduce`` default, lets pipeline schedules start each chunk's reduction); with the
    distributed optimizer, ``overlap_param_gather`` all-gathers the
    updated parameters bucket by bucket in the next forward's pre-hooks instead of in the
    optimizer step. Code that reads parameters outside a forward (weight sync, checkpoints) must
    first call :func:`gather_params`.

    Args:
        model_chunks: this rank's ``GPTModel`` chunks (one per virtual pipeline stage).
        use_distributed_optimizer: ``parallel.use_distributed_optimizer``; the gradient buffers
            are then reduce-scattered instead of all-reduced.
        overrides: ``DistributedDataParallelConfig`` fields from ``model.megatron_overrides``,
            applied last.
        overlap: default of ``overlap_grad_reduce`` and (with the distributed optimizer)
            ``overlap_param_gather``.

    Returns:
        The wrapped chunks, in order.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap and use_distributed_optimizer,
        "use_distributed_optimizer": use_distributed_optimizer, **(overrides or {})})
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=index > 0)
               for index, chunk in enumerate(model_chunks)]

    def hooks(name: str) -> list | object:  # one callable per chunk, or the callable itself for one chunk
        funcs = [getattr(chunk, name) for chunk in wrapped]
        return funcs[0] if len(funcs) == 1 else funcs

    config: Any = model_chunks[0].config  # shared by every chunk
    config.no_sync_func = hooks("no_sync") if ddp_config.overlap_grad_reduce else None
    # Megatron-LM's --align-grad-reduce (default on; not a DDP config field in Megatron-Core 0.16.1).
    config.grad_sync_func = hooks("start_grad_sync") if ddp_config.overlap_grad_reduce else None
    config.param_sync_func = (hooks("start_param_sync")
                              if ddp_config.overlap_param_gather and ddp_config.align_param_gather else None)
    for chunk in model_chunks:
        # The schedules call this after the last micro batch: DP (and expert-DP) gradient
        # reduction, and the TP all-reduce of sequence-parallel norm weights. Without it every
        # rank would step on its own gradient.
        chunk.config.finalize_model_grads_func = finalize_model_grads  # type: ignore[union-attr]  # Megatron's
    return wrapped


def gather_params(ddp_chunks: Sequence[torch.nn.Module]) -> None:
    """Make every rank's parameters current after an optimizer step (collective over data-parallel ranks).

    With ``overlap_param_gather`` the distributed optimizer updates only this rank's shard of the
    parameter buffer and leaves the all-gather to the next forward's pre-hooks; a reader outside
    a forward (weight sync, checkpoint) would see other shards' old values. Megatron's
    ``start_param_sync(force_sync=True)`` waits for an outstanding gather or runs one now. A no-op
    without ``overlap_param_gather``.
    """
    for chunk in ddp_chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)  # type: ignore[operator]  # Megatron's DDP


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
    model_config: Any = ddp_chunks[0].config
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
