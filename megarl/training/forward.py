"""One micro batch through the model: inputs, routing replay, logprobs, and the RL loss.

These functions are called from the ``forward_step_func`` closures that `megarl.training.trainer`
hands to Megatron's ``get_forward_backward_func``; they see one packed micro batch
(`megarl.training.micro_batch.PackedMicroBatch`) and one pipeline stage's model chunk.

Loss scaling (the contract of `megarl.algorithms.aggregation`): the loss of a micro batch is its
share of the global-batch loss (divided by the global denominators of the optimizer step), so the
sum over micro batches and data-parallel ranks is the global loss and the summed gradient is its
gradient. Megatron divides a ``(loss, metrics)`` result by the number of micro batches and DDP
averages gradients over the data-parallel group (a ``1 / dp_size`` factor, for expert weights
too), so `megarl.training.trainer.Trainer.forward_backward` multiplies each micro batch's loss
by ``num_microbatches * dp_size``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.algorithms import LossNormalizer, Metric, compute_policy_loss, entropy_bonus_loss, kl_penalty_loss
from megarl.config.schema import AlgorithmConfig
from megarl.training.batch import TrainBatch, packed_to_padded
from megarl.training.micro_batch import PackedMicroBatch
from megarl.training.logprobs import next_token_logprobs
from megarl.training.parallel_state import ParallelState
from megarl.training.routing_replay import RoutingReplay


@dataclasses.dataclass(kw_only=True)
class LossInputs:
    """What every micro batch's loss needs from the whole optimizer step.

    Attributes:
        batch: the step's `TrainBatch` (with ``old_logprobs``; ``ref_logprobs`` when ``kl_coef > 0``).
        loss_mask: ``[T_total]`` bool, the batch's loss mask after any rollout correction.
        is_weights: ``[T_total]`` float32 detached rollout-correction weights, or None.
        normalizer: the global loss denominators of the step (all micro batches, all DP ranks).
    """

    batch: TrainBatch
    loss_mask: Tensor
    is_weights: Tensor | None
    normalizer: LossNormalizer


def run_model(model: torch.nn.Module, mb: PackedMicroBatch, *, parallel: ParallelState,
              replay: RoutingReplay | None = None, routes: Tensor | None = None) -> Tensor:
    """Forward one packed micro batch through a model chunk, replaying routes if given.

    Args:
        model: a (DDP-wrapped) ``GPTModel`` chunk of this pipeline stage.
        mb: the packed micro batch (rows ``[R, S]``).
        parallel: this rank's parallel state (selects the sequence-parallel slice of ``routes``).
        replay: the model's `RoutingReplay`, or None.
        routes: ``[T_total, L, K]`` routes of the whole batch to replay, or None (route freely).

    Returns:
        Last stage: ``[R, S, V/tp]`` logits; other stages: the hidden states to send on.
    """
    if replay is not None and routes is not None:
        positions = mb.router_positions(tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
                                        sequence_parallel=parallel.sequence_parallel)
        replay.replay(mb.gather(routes, pad_value=-1)[positions])  # padding routes freely
    return model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)


def micro_batch_logprobs(logits: Tensor, mb: PackedMicroBatch, *, vocab_size: int, tp_group, temperature: float,
                         entropy: str) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and entropy) of the row's real tokens from its vocabulary-sharded logits.

    Args:
        logits: ``[R, S, V/tp]`` model output.
        mb: the micro batch.
        vocab_size: real vocabulary size (Megatron's padding ids are excluded).
        tp_group: the tensor-parallel process group.
        temperature: rollout sampling temperature (logits are divided by it; <= 0 means 1).
        entropy: ``"none"``, ``"metric"`` (detached) or ``"grad"`` (differentiable, for a bonus).

    Returns:
        ``(logprobs, entropy)``: ``[T_real]`` float32 each (entropy None for ``"none"``); entry
        ``t`` belongs to the batch token ``mb.token_index[t]`` (0 at sequence starts).
    """
    temperature = temperature if temperature > 0 else 1.0
    logprobs, ent = next_token_logprobs(logits, mb.input_ids, vocab_size=vocab_size, tp_group=tp_group,
                                        temperature=temperature, entropy=entropy)
    starts = mb.cu_seqlens[:-1]
    # real tokens only; a sequence start is "predicted" from the previous sequence of its row
    logprobs = logprobs.reshape(-1)[mb.flat_index].index_fill(0, starts, 0.0)
    if ent is not None:
        ent = ent.reshape(-1)[mb.flat_index].index_fill(0, starts, 0.0)
    return logprobs, ent


def rl_loss(logprobs: Tensor, entropy: Tensor | None, mb: PackedMicroBatch, *, inputs: LossInputs,
            algo: AlgorithmConfig) -> tuple[Tensor, dict[str, Metric]]:
    """The RL loss of one micro batch: its share of the global-batch loss.

    Args:
        logprobs: ``[T_real]`` float32 current-policy logprobs of the row's tokens (with grad).
        entropy: ``[T_real]`` per-token entropy (with grad for a bonus), or None.
        mb: the micro batch.
        inputs: the step-wide `LossInputs`.
        algo: the ``algorithm`` config section (loss name, clips, aggregation, KL, entropy).

    Returns:
        ``(loss, metrics)``: 0-dim loss (the caller applies Megatron's scaling, module
        docstring); metrics as ``Metric`` objects.
    """
    batch, cu = inputs.batch, mb.cu_seqlens
    if not mb.spec.seq_indices:  # padding-only micro batch: keep the graph, contribute nothing
        return logprobs.sum() * 0.0, {}
    index = mb.token_index
    padded = lambda values, fill=0.0: packed_to_padded(values, cu, pad_value=fill)  # noqa: E731
    lp = padded(logprobs)
    old = padded(batch.old_logprobs[index])
    mask = padded(inputs.loss_mask[index], False)
    advantages = batch.advantages[list(mb.spec.seq_indices)]
    is_weights = None if inputs.is_weights is None else padded(inputs.is_weights[index])
    ent = None if entropy is None else padded(entropy)
    kwargs = dict(clip_low=algo.clip_low, clip_high=algo.clip_high, loss_agg_mode=algo.loss_aggregation,
                  normalizer=inputs.normalizer, is_weights=is_weights,
                  entropy=None if ent is None else ent.detach())
    if algo.policy_loss == "ppo_clip":
        kwargs["clip_c"] = algo.clip_c
    loss, metrics = compute_policy_loss(algo.policy_loss, lp, old, advantages, mask, **kwargs)
    if algo.kl_coef > 0:
        kl_loss, kl_metrics = kl_penalty_loss(lp, padded(batch.ref_logprobs[index]), mask, kl_coef=algo.kl_coef,
                                              estimator=algo.kl_estimator,
                                              loss_agg_mode=algo.loss_aggregation, normalizer=inputs.normalizer)
        loss, metrics = loss + kl_loss, metrics | kl_metrics
    if algo.entropy_coef > 0:
        bonus, bonus_metrics = entropy_bonus_loss(ent, mask, entropy_coef=algo.entropy_coef,
                                                  loss_agg_mode=algo.loss_aggregation, normalizer=inputs.normalizer)
        loss, metrics = loss + bonus, metrics | bonus_metrics
    metrics["loss/total"] = Metric(loss.detach(), "sum", torch.ones((), dtype=loss.dtype))
    return loss, metrics


def tp_group_of(parallel: ParallelState):
    """Megatron's tensor-parallel process group (None at TP size 1)."""
    if parallel.tp_size == 1:
        return None
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_group()


def all_reduce_metrics(metrics: dict[str, Metric], *, contribute: bool) -> dict[str, float]:
    """Combine per-rank metrics over the whole world group into plain floats.

    Every rank must call this. Ranks with ``contribute=False`` (not the last pipeline stage, or a
    TP rank > 0 holding a duplicate) add the identity of each reduction. Means are weighted by
    their ``weight`` (items), sums add, max/min take the extreme (see `megarl.algorithms.metrics`).

    Args:
        metrics: this rank's micro-batch-reduced metrics (``megarl.algorithms.reduce_metrics``).
        contribute: whether this rank's values count.

    Returns:
        ``{name: value}`` identical on every rank; a mean over zero items is 0, an empty max/min
        is dropped.
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(metrics) if contribute else [])
    names = sorted({name for names in gathered for name in names})
    reductions = {}
    for name in names:
        local = metrics.get(name) if contribute else None
        reductions[name] = local.reduction if local is not None else None
    kinds: list = [None] * dist.get_world_size()
    dist.all_gather_object(kinds, reductions)
    kind = {name: next(k[name] for k in kinds if k.get(name)) for name in names}
    sums = torch.zeros(2 * len(names), dtype=torch.float64)
    maxes = torch.full((len(names),), float("-inf"), dtype=torch.float64)
    for i, name in enumerate(names):
        metric = metrics.get(name) if contribute else None
        if metric is None:
            continue
        value, weight = metric.value.double(), metric.weight.double()
        if kind[name] == "mean":
            sums[2 * i], sums[2 * i + 1] = value * weight, weight
        elif kind[name] == "sum":
            sums[2 * i] = value
        else:
            maxes[i] = value if kind[name] == "max" else -value  # min = -max(-x)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    out = {}
    for i, name in enumerate(names):
        if kind[name] == "mean":
            out[name] = float(sums[2 * i] / sums[2 * i + 1].clamp(min=1))
        elif kind[name] == "sum":
            out[name] = float(sums[2 * i])
        elif torch.isfinite(maxes[i]):
            out[name] = float(maxes[i]) if kind[name] == "max" else -float(maxes[i])
    return out
