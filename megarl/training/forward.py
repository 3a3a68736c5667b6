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
import functools

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.algorithms import (
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    LossNormalizer,
    Metric,
    RolloutCorrection,
    drift_filter,
    entropy_bonus_loss,
    kl_penalty_loss,
)
from megarl.algorithms.corrections import mismatch_metrics
from megarl.config.schema import AlgorithmConfig
from megarl.training.batch import TrainBatch, packed_to_padded
from megarl.training.collectives import all_gather_object, all_reduce
from megarl.training.context_parallel import CPMicroBatch, cp_micro_batch_logprobs
from megarl.training.logprobs import hand_over_logits, next_token_logprobs
from megarl.training.micro_batch import PackedMicroBatch
from megarl.training.parallel_state import ParallelState
from megarl.training.routing_replay import RoutingReplay, store_routes


@dataclasses.dataclass(kw_only=True)
class LossInputs:
    """What every micro batch's loss needs from the whole optimizer step, on the compute device.

    Attributes:
        old_logprobs: ``[T_total]`` float32 logprobs at the sampling-time weights.
        ref_logprobs: ``[T_total]`` float32 reference logprobs (``kl_coef > 0``), or None.
        advantages: ``[B]`` float32.
        loss_mask: ``[T_total]`` bool, the batch's loss mask after any rollout correction.
        is_weights: ``[T_total]`` float32 detached rollout-correction weights, or None.
        normalizer: the global loss denominators of the step (all micro batches, all DP ranks).
    """

    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    is_weights: Tensor | None
    normalizer: LossNormalizer


def loss_inputs(batch: TrainBatch, algo: AlgorithmConfig, *, device: torch.device | str,
                max_response_tokens: int, dp_group=None) -> tuple[LossInputs, dict[str, Metric]]:
    """Drift filter and rollout correction over this rank's sequences; the step's loss denominators.

    Trajectories over ``algorithm.max_behaviour_drift`` are dropped from the loss mask first
    (`megarl.algorithms.drift.drift_filter`, a pure function of each trajectory). The correction
    (``algorithm.rollout_correction`` of `megarl.algorithms.corrections`, ``old_logprobs`` vs the
    engine's ``rollout_logprobs``) then runs on the kept ones. Both are per token or per sequence,
    so they run once on the rank's whole shard and decide the same whichever micro batch (or rank)
    a sequence lands in; the denominators are then counted from the final loss mask and summed
    over the data-parallel group (the contract of `megarl.algorithms.aggregation`).

    Args:
        batch: the rank's shard of the step (or the whole step), with ``old_logprobs`` (and
            ``ref_logprobs`` when ``kl_coef > 0``).
        algo: the ``algorithm`` config section.
        device: the compute device (the tensors of the result are moved there).
        max_response_tokens: ``L_max`` of ``seq_mean_token_sum_norm``.
        dp_group: the data-parallel process group holding the rest of the step: the counts are
            all-reduced (SUM) over it, on its device (`megarl.training.collectives`); None:
            ``batch`` is the whole step.

    Returns:
        ``(inputs, metrics)``: the `LossInputs`, and the drift filter's ``filter/*`` /
        ``mismatch/behaviour_drift_*`` and the correction's ``mismatch/*`` metrics of this shard as
        `Metric` (reduce them over ranks; empty with neither).

    Raises:
        ValueError: an unknown ``algorithm.rollout_correction`` or ``behaviour_drift_statistic``,
            or ``max_behaviour_drift <= 0``; a batch without ``old_logprobs``.
    """
    old_logprobs = _old_logprobs(batch)
    loss_mask, is_weights, metrics = batch.loss_mask, None, {}
    if algo.max_behaviour_drift is not None or algo.rollout_correction != "none":
        pad = functools.partial(packed_to_padded, cu_seqlens=batch.cu_seqlens)
        real = pad(torch.ones(batch.num_tokens, dtype=torch.bool), pad_value=False)  # [B, T] real tokens
        old, behaviour = pad(old_logprobs), pad(batch.rollout_logprobs)
        padded_mask = pad(loss_mask, pad_value=False)
        if algo.max_behaviour_drift is not None:  # drop before the correction: it weights the kept ones
            dropped = drift_filter(old, behaviour, padded_mask, max_drift=algo.max_behaviour_drift,
                                   statistic=algo.behaviour_drift_statistic)
            padded_mask, metrics = dropped.loss_mask, dict(dropped.metrics)
        if algo.rollout_correction != "none":
            result = _rollout_correction(old, behaviour, padded_mask, algo)
            padded_mask, is_weights = result.loss_mask, result.weights[real].float()
            metrics.update(result.metrics)
        loss_mask = padded_mask[real]
    normalizer = LossNormalizer.from_loss_mask(packed_to_padded(loss_mask, batch.cu_seqlens, pad_value=False),
                                               max_response_tokens=float(max_response_tokens))
    if dp_group is not None:  # every rank's share of the step: exact integer counts in float64
        counts = all_reduce(torch.stack([torch.as_tensor(normalizer.num_tokens), torch.as_tensor(normalizer.num_seqs)]),
                            group=dp_group)
        normalizer = LossNormalizer(num_tokens=counts[0], num_seqs=counts[1],
                                    max_response_tokens=normalizer.max_response_tokens)
    to = functools.partial(torch.Tensor.to, device=device)
    inputs = LossInputs(old_logprobs=to(old_logprobs),
                        ref_logprobs=None if batch.ref_logprobs is None else to(batch.ref_logprobs),
                        advantages=to(batch.advantages), loss_mask=to(loss_mask),
                        is_weights=None if is_weights is None else to(is_weights), normalizer=normalizer)
    return inputs, metrics


def mismatch(batch: TrainBatch) -> dict[str, Metric]:
    """``mismatch/*`` of a prepared batch: its trainer ``old_logprobs`` vs the engine's
    ``rollout_logprobs`` on its trained tokens (`megarl.algorithms.corrections.mismatch_metrics`,
    on the sequences padded to ``[B, T_max]``).

    Raises:
        ValueError: the batch has no ``old_logprobs``.
    """
    pad = functools.partial(packed_to_padded, cu_seqlens=batch.cu_seqlens)
    return mismatch_metrics(pad(_old_logprobs(batch).float()), pad(batch.rollout_logprobs.float()),
                            pad(batch.loss_mask, pad_value=False))


def _old_logprobs(batch: TrainBatch) -> Tensor:
    """``batch.old_logprobs``; raises ValueError when it has none (not prepared: `Trainer.prepare`)."""
    if batch.old_logprobs is None:
        raise ValueError("the batch has no old_logprobs (the trainer's logprobs at the sampling-time weights); "
                         "prepare it first")
    return batch.old_logprobs


def _rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                        algo: AlgorithmConfig) -> RolloutCorrection:
    """``algorithm.rollout_correction`` (a registered name or an import path) on ``[B, T]`` padded
    tensors, with the hyperparameters its entry declares (its bounds, its level).

    Raises:
        ValueError: an unknown ``algorithm.rollout_correction`` (`megarl.plugins.PluginError`).
    """
    correction = ROLLOUT_CORRECTIONS.resolve(algo.rollout_correction)
    return correction.fn(old_logprobs, rollout_logprobs, loss_mask, **correction.keywords(algo))


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer of a (DDP-wrapped) ``GPTModel`` chunk of the last stage, else None."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = _submodule(model, "module")
    if getattr(model, "post_process", False) and hasattr(model, "output_layer"):
        return _submodule(model, "output_layer")
    return None


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model.<name>``; raises TypeError when that is not a module (a parameter or buffer)."""
    sub = getattr(model, name)
    if not isinstance(sub, torch.nn.Module):
        raise TypeError(f"{type(model).__name__}.{name} is a {type(sub).__name__}, not a torch.nn.Module")
    return sub


def run_model(model: torch.nn.Module, mb: PackedMicroBatch, *, parallel: ParallelState,
              replay: RoutingReplay | None = None, routes: Tensor | None = None) -> Tensor:
    """Forward one packed micro batch through a model chunk, replaying routes if given.

    The last stage returns the output layer's own ``[S, R, V/tp]`` logits: ``GPTModel`` would
    return them as ``[R, S, V/tp]`` through ``logits.transpose(0, 1).contiguous()`` (a copy, and a
    second copy of their gradient in the output layer's backward). A forward hook on the output
    layer hands ``GPTModel`` the transposed view, so its ``transpose(0, 1).contiguous()`` is the
    logits themselves (no copy; Megatron-Core 0.16.1, ``GPTModel._postprocess``), and keeps the
    logits, which are returned marked by `megarl.training.logprobs.hand_over_logits`: the logprob
    pass works in their memory.

    Args:
        model: a (DDP-wrapped) ``GPTModel`` chunk of this pipeline stage.
        mb: the packed micro batch (rows ``[R, S]``).
        parallel: this rank's parallel state (selects the sequence-parallel slice of ``routes``).
        replay: the model's `RoutingReplay`, or None.
        routes: ``[T, L, K]`` routes of the batch ``mb`` was packed from (this rank's shard) to replay,
            or None (route freely).

    Returns:
        Last stage: ``[S, R, V/tp]`` logits (contiguous); other stages: the hidden states to send on.
    """
    if replay is not None and routes is not None:
        positions = mb.router_positions(tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
                                        sequence_parallel=parallel.sequence_parallel)
        row = mb.gather(routes, pad_value=-1)[positions.to(routes.device)]  # padding routes freely
        replay.replay(row, chunk=model)
    output_layer = _output_layer(model)
    if output_layer is None:
        return model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
    kept = []

    def keep_logits(module, args, output):
        logits, bias = output  # ColumnParallelLinear: [S, R, V/tp] and its (None) bias
        kept.append(logits)
        return logits.transpose(0, 1), bias

    handle = output_layer.register_forward_hook(keep_logits)
    try:
        model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
    finally:
        handle.remove()
    return hand_over_logits(kept[-1])  # the last call: the main head (after any MTP heads)


def micro_batch_logprobs(logits: Tensor, mb: PackedMicroBatch, *, vocab_size: int, tp_group, temperature: float,
                         entropy: str) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and entropy) of the row's real tokens from its vocabulary-sharded logits.

    Args:
        logits: ``[S, R, V/tp]`` `run_model` output (one row: ``[1, S, V/tp]`` too; a `CPMicroBatch`:
            ``S / cp`` positions, this CP rank's). Logits from `run_model` are consumed (overwritten).
        mb: the micro batch.
        vocab_size: real vocabulary size (Megatron's padding ids are excluded).
        tp_group: the tensor-parallel process group.
        temperature: rollout sampling temperature (logits are divided by it; <= 0 means 1).
        entropy: ``"none"``, ``"metric"`` (detached, exact, from the logprob pass's log-sum-exp) or
            ``"grad"`` (differentiable, for a bonus).

    Returns:
        ``(logprobs, entropy)``: ``[T_real]`` float32 each (entropy None for ``"none"``); entry
        ``t`` belongs to the batch token ``mb.token_index[t]`` (0 at sequence starts).
    """
    if isinstance(mb, CPMicroBatch):  # this CP rank's positions only: gathered over the CP group
        return cp_micro_batch_logprobs(logits, mb, vocab_size=vocab_size, tp_group=tp_group, temperature=temperature,
                                       entropy=entropy)
    temperature = temperature if temperature > 0 else 1.0
    logprobs, ent = next_token_logprobs(logits, mb.input_ids, vocab_size=vocab_size, tp_group=tp_group,
                                        temperature=temperature, entropy=entropy, seq_first=True)
    starts = mb.cu_seqlens[:-1]
    # real tokens only; a sequence start is "predicted" from the previous sequence of its row
    logprobs = logprobs.reshape(-1)[mb.flat_index].index_fill(0, starts, 0.0)
    if ent is not None:
        ent = ent.reshape(-1)[mb.flat_index].index_fill(0, starts, 0.0)
    return logprobs, ent


def step_func(loss_of, *, parallel: ParallelState, replay: RoutingReplay | None, routes: Tensor | None,
              vocab_size: int, tp_group, temperature: float, entropy: str, recorded: Tensor | None = None):
    """Megatron's ``forward_step_func`` for one pass over a rank's micro batches.

    Each micro batch runs through the model chunk (`run_model`, replaying ``routes``); its logits
    become logprobs (`micro_batch_logprobs`) and ``loss_of(logprobs [T_real], entropy [T_real] |
    None, mb, output_tensor)`` gives the loss Megatron backpropagates (a forward-only pass returns a
    zero).

    Args:
        recorded: ``[T_total, L, K]`` int32, filled with the routes the routers chose (R2 recording,
            `megarl.training.routing_replay.store_routes`); None: nothing recorded.
        Others: as `run_model` and `micro_batch_logprobs` take them.

    Raises:
        ValueError: ``recorded`` without ``replay`` (the routers are recorded through it).
    """
    recording: tuple[Tensor, RoutingReplay] | None = None
    if recorded is not None:
        if replay is None:
            raise ValueError("step_func: recording routes (recorded) needs the model's RoutingReplay, got replay=None")
        recording = (recorded, replay)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if recording is not None:
            recording[1].record(chunk=model)
        output = run_model(model, mb, parallel=parallel, replay=replay, routes=routes)
        if recording is not None:
            store_routes(recording[0], mb, recording[1].take_recorded(chunk=model), parallel)

        def loss_func(output_tensor):
            logprobs, ent = micro_batch_logprobs(output_tensor, mb, vocab_size=vocab_size, tp_group=tp_group,
                                                 temperature=temperature, entropy=entropy)
            return loss_of(logprobs, ent, mb, output_tensor), {}
        return output, loss_func
    return forward_step


def rl_loss(logprobs: Tensor, entropy: Tensor | None, mb: PackedMicroBatch, *, inputs: LossInputs,
            algo: AlgorithmConfig) -> tuple[Tensor, dict[str, Metric]]:
    """The RL loss of one micro batch: its share of the global-batch loss.

    Args:
        logprobs: ``[T_real]`` float32 current-policy logprobs of the row's tokens (with grad).
        entropy: ``[T_real]`` per-token entropy (with grad for a bonus), or None.
        mb: the micro batch.
        inputs: the step-wide `LossInputs`.
        algo: the ``algorithm`` config section: the policy loss (a registered name or an import
            path, `megarl.algorithms.extensions.POLICY_LOSSES`) gets the hyperparameters its entry
            declares and ``policy_loss_kwargs``; aggregation, KL and entropy apply to every loss.

    Returns:
        ``(loss, metrics)``: 0-dim loss (the caller applies Megatron's scaling, module
        docstring); metrics as ``Metric`` objects.

    Raises:
        ValueError: ``kl_coef > 0`` without ``inputs.ref_logprobs``; ``entropy_coef > 0`` without ``entropy``.
    """
    cu = mb.cu_seqlens
    if not mb.spec.seq_indices:  # padding-only micro batch: keep the graph, contribute nothing
        return logprobs.sum() * 0.0, {}
    index = mb.token_index
    padded = lambda values, fill=0.0: packed_to_padded(values, cu, pad_value=fill)  # noqa: E731
    lp = padded(logprobs)
    old = padded(inputs.old_logprobs[index])
    mask = padded(inputs.loss_mask[index], False)
    advantages = inputs.advantages[torch.tensor(mb.spec.seq_indices, device=inputs.advantages.device)]
    is_weights = None if inputs.is_weights is None else padded(inputs.is_weights[index])
    ent = None if entropy is None else padded(entropy)
    policy_loss = POLICY_LOSSES.resolve(algo.policy_loss)
    loss, metrics = policy_loss.fn(lp, old, advantages, mask, loss_agg_mode=algo.loss_aggregation,
                                   normalizer=inputs.normalizer, is_weights=is_weights,
                                   entropy=None if ent is None else ent.detach(), **policy_loss.keywords(algo))
    if algo.kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs the reference logprobs (inputs.ref_logprobs is None)")
        kl_loss, kl_metrics = kl_penalty_loss(lp, padded(inputs.ref_logprobs[index]), mask, kl_coef=algo.kl_coef,
                                              estimator=algo.kl_estimator,
                                              loss_agg_mode=algo.loss_aggregation, normalizer=inputs.normalizer)
        loss, metrics = loss + kl_loss, metrics | kl_metrics
    if algo.entropy_coef > 0:
        if ent is None:
            raise ValueError("algorithm.entropy_coef > 0 needs the entropy (the pass ran with entropy='none')")
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
    local = {name: m.reduction for name, m in metrics.items()} if contribute else {}
    gathered = all_gather_object(local)
    kind = {name: reduction for kinds in gathered for name, reduction in kinds.items()}
    names = sorted(kind)
    sums = torch.zeros(2 * len(names), dtype=torch.float64)
    maxes = torch.full((len(names),), float("-inf"), dtype=torch.float64)
    for i, name in enumerate(names):
        metric = metrics.get(name) if contribute else None
        if metric is None:
            continue
        value, weight = metric.value.double().cpu(), metric.weight.double().cpu()
        if kind[name] == "mean":
            sums[2 * i], sums[2 * i + 1] = value * weight, weight
        elif kind[name] == "sum":
            sums[2 * i] = value
        else:
            maxes[i] = value if kind[name] == "max" else -value  # min = -max(-x)
    all_reduce(sums)  # on the default group's device (megarl.training.collectives)
    all_reduce(maxes, op=dist.ReduceOp.MAX)
    out = {}
    for i, name in enumerate(names):
        if kind[name] == "mean":
            out[name] = float(sums[2 * i] / sums[2 * i + 1].clamp(min=1))
        elif kind[name] == "sum":
            out[name] = float(sums[2 * i])
        elif torch.isfinite(maxes[i]):
            out[name] = float(maxes[i]) if kind[name] == "max" else -float(maxes[i])
    return out
