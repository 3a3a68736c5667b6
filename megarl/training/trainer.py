"""The Megatron-Core policy trainer: one object per trainer rank, inside an initialised process group.

Built by `build_trainer(cfg, load_weights=...)` from small ``build_*`` functions (parallel state,
model, initial weights, DDP, optimizer, LR schedule); the driver then calls, per RL step (through
`megarl.launch.trainer_group.TrainerGroup`)::

    metrics = trainer.prepare(shard)          # old logprobs (+ R2 routes), ref logprobs, mismatch
    metrics = trainer.train_prepared(i)       # one optimizer step per mini-batch i of the shard

Each rank receives only its data-parallel **shard** (`megarl.training.shard.BatchShard`: the
sequences the micro-batch planner gives its ``dp_rank``, mini-batch by mini-batch, and the lengths
of every sequence of each mini-batch); the ranks sharing a ``dp_rank`` (TP / CP / PP) receive the
same shard. Old / reference logprobs and R2 routes are computed on the shard and kept on the rank
(reduced over those peers only); every result returned is a metric reduced over all ranks, never
a tensor of batch size. ``compute_logprobs``, ``prepare_batch`` and ``train_step`` also accept the
whole batch on every rank (probes, tests, tools): ``train_step`` then cuts its own shard exactly as
the driver would. ``compute_logprobs`` and ``train_step`` plan micro batches the same way, so for the
same batch and weights the old-logprob pass and the training forward see identical micro batches
(on-policy ratios are exactly 1).

Step anatomy (``train_prepared``): routes validated (routing replay) -> drift filter
(``algorithm.max_behaviour_drift``, `megarl.algorithms.drift`) and rollout correction on the rank's
shard (per token or sequence; detached weights, possibly a smaller loss mask) -> loss
denominators counted from that mask and summed over the data-parallel group -> Megatron
``get_forward_backward_func`` over this rank's micro batches and the pipeline stages (loss scaling
in `megarl.training.forward`) -> DDP gradient reduction in ``finalize_model_grads`` -> optimizer
step with gradient clipping -> LR schedule step -> metrics reduced over micro batches and ranks.

Context parallelism (Transformer Engine attention only): each micro batch is one THD row split
over the CP ranks; every CP rank computes the whole micro batch's loss from logprobs gathered over
the CP group (`megarl.training.context_parallel`).
"""
from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import Tensor

from megarl.algorithms import reduce_metrics
from megarl.config.schema import MegarlConfig
from megarl.models.families import text_config_of
from megarl.training import forward as fwd
from megarl.training import rank_plan
from megarl.training.batch import TrainBatch
from megarl.training.collectives import all_reduce
from megarl.training.micro_batch import PackedMicroBatch
from megarl.training.parallel_state import ParallelState
from megarl.training.reference import reference_weights, snapshot
from megarl.training.routing_replay import RoutingReplay, replay_routes
from megarl.training.shard import BatchShard, StepView, shard_batch


class Trainer:
    """Policy trainer on one rank. Prefer `build_trainer`; the constructor takes built parts.

    Args:
        cfg: the run config.
        parallel: this rank's `ParallelState`.
        model_chunks: DDP-wrapped ``GPTModel`` chunks of this rank (one per virtual stage).
        optimizer: the Megatron optimizer over ``model_chunks``.
        scheduler: Megatron ``OptimizerParamScheduler``.
        hf_config: the model's Hugging Face config (real vocabulary size, number of layers).
    """

    def __init__(self, cfg: MegarlConfig, *, parallel: ParallelState, model_chunks: list, optimizer, scheduler,
                 hf_config) -> None:
        self.cfg, self.parallel, self.hf_config = cfg, parallel, hf_config
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        text_config = text_config_of(hf_config)  # a vision-language config nests it (Kimi-K2.5)
        self.vocab_size = text_config.vocab_size
        """Real (unpadded) vocabulary size; Megatron's padding ids are excluded from the softmax."""
        self.num_layers = text_config.num_hidden_layers
        """Transformer layers of the whole model (the ``L`` axis of routed experts)."""
        self.config = model_chunks[0].config
        self.device = next(model_chunks[0].parameters()).device
        """Where the model (and each micro batch's tensors) live."""
        self.step = 0
        """Optimizer steps taken (restored by checkpoint load)."""
        self.replay = RoutingReplay(model_chunks) if cfg.train.routing_replay != "none" else None
        # With activation recomputation the recomputed router replays its forward's routes
        # (megarl.training.routing_replay, "Activation recomputation").
        self.ref_weights = snapshot(model_chunks) if cfg.algorithm.kl_coef > 0 else None
        self._tp_group = fwd.tp_group_of(parallel)
        length_policy = rank_plan.length_policy(model_chunks, parallel)
        if parallel.pp_size > 1:
            rank_plan.configure_pipeline_p2p(model_chunks, length_policy)
        # Transformer Engine attention takes THD packed sequences; the local spec's takes a mask.
        self._te_attention = rank_plan.uses_te_attention(model_chunks)
        self._cp_group = rank_plan.cp_group(parallel, te_attention=self._te_attention)
        self._peer_group = rank_plan.peer_group(parallel)
        """The ranks holding the same data-parallel shard (TP x CP x PP), or `rank_plan.ALONE`."""
        self._dp_group = rank_plan.dp_group(parallel)
        """The data-parallel group (without CP) the step's loss denominators are summed over; None at DP 1."""
        self._planner = rank_plan.MicroBatchPlanner(
            parallel=parallel, train=cfg.train, length_policy=length_policy, te_attention=self._te_attention,
            num_model_chunks=len(model_chunks), cp_group=self._cp_group, device=self.device)
        self._prepared: list[tuple[TrainBatch, StepView]] | None = None
        """This rank's prepared mini-batches of the step (`prepare`), for `train_prepared`."""

    # ------------------------------------------------------------------ planning
    def micro_batches(self, batch: TrainBatch, step: StepView | None = None) -> tuple[list[PackedMicroBatch], float]:
        """This rank's packed micro batches of ``batch`` and the plan's padding fraction
        (`megarl.training.rank_plan.MicroBatchPlanner.micro_batches`)."""
        return self._planner.micro_batches(batch, step)

    def _run(self, step_func, mbs: list[PackedMicroBatch], *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iters = [iter(mbs) for _ in self.model_chunks]
        num_rows, row_length = mbs[0].shape  # p2p shape; all micro batches share it unless variable_seq_lengths
        return get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.model_chunks, num_microbatches=len(mbs),
            seq_length=row_length, micro_batch_size=num_rows, forward_only=forward_only)

    @property
    def _reports(self) -> bool:
        """Whether this rank holds results others do not (last stage, first TP rank, first CP rank:
        CP ranks compute the same whole-sequence logprobs and losses)."""
        return self.parallel.is_last_stage and self.parallel.tp_rank == 0 and self.parallel.cp_rank == 0

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False,
                         temperature: float | None = None) -> Tensor:
        """Per-token logprobs of the batch under the current (or reference) policy.

        Args:
            batch: the batch (every rank passes the same one; small: probes, tests, tools).
            reference: use the reference weights (``algorithm.kl_coef > 0``; swapped in from CPU).
            temperature: logits are divided by it; None: the sampling temperature
                (``rollout.sampling.temperature``, the distribution rollouts were sampled from).

        Returns:
            ``[T_total]`` float32 logprobs (0 at sequence starts), identical on every rank.

        Raises:
            ValueError: ``reference=True`` without reference weights.
        """
        return self._forward_only(batch, None, reference=reference, record_routes=False, temperature=temperature)[0]

    def prepare_batch(self, batch: TrainBatch, step: StepView | None = None) -> TrainBatch:
        """Fill ``old_logprobs``, R2 ``routed_experts`` (recorded in the same forward pass) and,
        with a KL penalty, ``ref_logprobs``.

        Args:
            batch: the whole step (every rank passes it; ``step`` None), or this rank's shard of
                one optimizer step (``step`` places it): then the results are this shard's rows,
                reduced over the ranks sharing its data-parallel rank only.

        Fields already set are kept. Returns a new batch; the input is unchanged.
        """
        changes: dict[str, Any] = {}
        record = self.cfg.train.routing_replay == "r2" and batch.routed_experts is None
        if batch.old_logprobs is None or record:
            with torch.no_grad():
                old, routes = self._forward_only(batch, step, reference=False, record_routes=record)
            if batch.old_logprobs is None:
                changes["old_logprobs"] = old
            if record:
                changes["routed_experts"] = routes
        if self.cfg.algorithm.kl_coef > 0 and batch.ref_logprobs is None:
            with torch.no_grad():
                changes["ref_logprobs"] = self._forward_only(batch, step, reference=True, record_routes=False)[0]
        return batch.replace(**changes) if changes else batch

    def prepare(self, shard: BatchShard) -> dict[str, float]:
        """Prepare this rank's shard of an RL step (`prepare_batch` per mini-batch) and keep it
        for the following `train_prepared` calls.

        Args:
            shard: this data-parallel rank's `BatchShard` (routes already resolved).

        Returns:
            ``mismatch/*`` (trainer ``old_logprobs`` vs the engine's ``rollout_logprobs`` on trained
            tokens, `megarl.algorithms.corrections.mismatch_metrics`) reduced over every rank's
            shard; the same on every rank.

        Raises:
            ValueError: the shard is for another data-parallel rank or layout.
        """
        p = self.parallel
        if (shard.dp_rank, shard.dp_size) != (p.dp_rank, p.dp_size):
            raise ValueError(f"shard for data-parallel rank {shard.dp_rank} of {shard.dp_size} sent to rank "
                             f"{p.dp_rank} of {p.dp_size}")
        self._prepared = [(self.prepare_batch(shard.mini(m), shard.view(m)), shard.view(m))
                          for m in range(shard.num_minis)]
        per_mini = [fwd.mismatch(batch) for batch, _ in self._prepared]
        return fwd.all_reduce_metrics(reduce_metrics(per_mini), contribute=self._reports)

    def train_prepared(self, mini: int) -> dict[str, float]:
        """One optimizer step on mini-batch ``mini`` of the shard kept by `prepare` (see `train_step`).

        Raises:
            RuntimeError: `prepare` was not called; IndexError: no such mini-batch.
        """
        if self._prepared is None:
            raise RuntimeError("Trainer.train_prepared needs a Trainer.prepare(shard) first")
        if not 0 <= mini < len(self._prepared):
            raise IndexError(f"mini-batch {mini} of a step with {len(self._prepared)}")
        batch, step = self._prepared[mini]
        return self._train(batch, step, prepare_s=0.0)

    def _forward_only(self, batch: TrainBatch, step: StepView | None, *, reference: bool, record_routes: bool,
                      temperature: float | None = None) -> tuple[Tensor, Tensor | None]:
        """Logprobs ``[T]`` (and R2 routes ``[T, L, K]``) of ``batch``'s tokens; a whole batch is
        reduced over every rank, a shard (``step`` set) over the ranks sharing its ``dp_rank``."""
        if reference and self.ref_weights is None:
            raise ValueError("reference logprobs need algorithm.kl_coef > 0 (no reference weights kept)")
        routes = None
        if not reference and not record_routes:  # R3 replays the engine's routes in the old pass too
            routes = replay_routes(batch, self.config, self.num_layers, enabled=self.replay is not None,
                                   required=self.cfg.train.routing_replay == "r3")
        mbs, _ = self.micro_batches(batch, step)
        temperature = self.cfg.rollout.sampling.temperature if temperature is None else temperature
        logprobs = torch.zeros(batch.num_tokens, dtype=torch.float32)
        recorded = torch.zeros(batch.num_tokens, self.num_layers, self.config.moe_router_topk or 1,
                               dtype=torch.int32) if record_routes else None

        def keep(lp, _, mb, output_tensor):
            if self._reports:
                logprobs[mb.token_index.cpu()] = lp.detach().float().cpu()
            return output_tensor.new_zeros(())

        step_func = fwd.step_func(keep, parallel=self.parallel, replay=self.replay, routes=routes, entropy="none",
                                  vocab_size=self.vocab_size, tp_group=self._tp_group, temperature=temperature,
                                  recorded=recorded)
        with reference_weights(self.model_chunks, self.ref_weights if reference else None):
            self._run(step_func, mbs, forward_only=True)
        if self.replay is not None:
            self.replay.off()
        for tensor in (logprobs, recorded):
            if tensor is not None and (step is None or self._peer_group is not rank_plan.ALONE):
                # on the group's device (collectives.py), back on the CPU
                all_reduce(tensor, group=None if step is None else self._peer_group)
        if recorded is not None:
            recorded -= 1
        return logprobs, recorded

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: TrainBatch, loss_fn, *, entropy: str = "none", routes: Tensor | None = None,
                         forward_only: bool = False, temperature: float | None = None,
                         step: StepView | None = None) -> tuple[list[dict], dict[str, float]]:
        """Run a loss over this rank's micro batches through Megatron's schedule (all ranks call).

        Gradients are zeroed first and, after it returns, hold the gradient of the sum of the
        losses over all micro batches and data-parallel ranks (Megatron's ``1 / num_microbatches``
        and DDP's ``1 / dp_size`` are undone here). Step the optimizer with `optimizer_step`.

        Args:
            batch: the batch (every rank passes the same one), or with ``step`` this rank's shard.
            loss_fn: ``loss_fn(logprobs [T_real], entropy [T_real] | None, mb) -> (loss, metrics)``,
                ``loss`` being the micro batch's share of the global loss (divided by global
                denominators); a padding-only micro batch (``mb.spec.seq_indices == ()``) must
                still return a loss connected to ``logprobs`` (``logprobs.sum() * 0``).
            entropy: ``none``, ``metric`` or ``grad`` (see `megarl.training.logprobs.next_token_logprobs`).
            routes: ``[T_total, L, K]`` routes to replay, or None.
            forward_only: no backward pass (and no gradient zeroing).
            temperature: logits are divided by it before the log-softmax; None: the sampling
                temperature (``rollout.sampling.temperature``, what the RL losses need).
            step: where the shard ``batch`` sits in the optimizer step (None: ``batch`` is the step).

        Returns:
            ``(metrics, batch_metrics)``: the ``metrics`` dicts ``loss_fn`` returned on this rank
            (reduce them with `reduce`), and ``batch/padding_fraction`` (of the whole plan) and
            ``batch/num_microbatches`` (per rank).
        """
        mbs, padding_fraction = self.micro_batches(batch, step)
        # dp_size excludes CP; Megatron's cp_size / num_microbatches and DDP's 1 / (dp_size * cp_size)
        # then cancel (megarl.training.context_parallel)
        scale = len(mbs) * self.parallel.dp_size
        sink: list[dict] = []
        temperature = self.cfg.rollout.sampling.temperature if temperature is None else temperature

        def scaled_loss(logprobs, ent, mb, _):
            loss, metrics = loss_fn(logprobs, ent, mb)
            sink.append(metrics)
            return loss * scale

        step_func = fwd.step_func(scaled_loss, parallel=self.parallel, replay=self.replay, routes=routes,
                                  entropy=entropy, vocab_size=self.vocab_size, tp_group=self._tp_group,
                                  temperature=temperature)
        if not forward_only:
            for chunk in self.model_chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        try:
            self._run(step_func, mbs, forward_only=forward_only)
        finally:
            if self.replay is not None:
                self.replay.off()
        return sink, {"batch/padding_fraction": padding_fraction, "batch/num_microbatches": float(len(mbs))}

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the LR schedule; ``optim/*`` metrics (same on every rank)."""
        update_successful, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        return {"optim/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "optim/lr": float(self.optimizer.param_groups[0]["lr"]),
                "optim/update_successful": float(bool(update_successful)), "optim/step": float(self.step)}

    def reduce(self, metrics: list[dict]) -> dict[str, float]:
        """Combine per-micro-batch ``Metric`` dicts over micro batches and ranks (all ranks call)."""
        return fwd.all_reduce_metrics(reduce_metrics(metrics), contribute=self._reports)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the configured RL loss on the whole batch (module docstring).

        Every rank passes the same batch and trains its data-parallel shard of it, exactly as
        the driver's `prepare` / `train_prepared` path does (`megarl.training.shard.shard_batch`).

        Args:
            batch: the step; missing ``old_logprobs`` (and R2 routes, reference logprobs) are
                computed first with `prepare_batch`.

        Returns:
            ``{name: value}`` metrics, the same on every rank: ``loss/*``, ``kl/*`` (the algorithm
            library's, reduced over micro batches and data-parallel ranks), ``mismatch/*`` (with
            a rollout correction), ``optim/grad_norm`` (before clipping), ``optim/lr``,
            ``optim/update_successful``, ``batch/padding_fraction``, ``batch/num_microbatches``,
            ``batch/num_tokens``, ``perf/tokens_per_s`` (all ranks' real tokens / step time),
            ``timing/*_s``.

        Raises:
            RoutingReplayError: replay is on and the batch's routes are missing or invalid.
        """
        start = time.perf_counter()
        p = self.parallel
        shard = shard_batch(batch, dp_size=p.dp_size, global_batch_size=batch.num_sequences, cp_size=p.cp_size)
        mine = shard[p.dp_rank]
        prepared = self.prepare_batch(mine.batch, mine.view(0))
        return self._train(prepared, mine.view(0), prepare_s=time.perf_counter() - start)

    def _train(self, batch: TrainBatch, step: StepView, *, prepare_s: float) -> dict[str, float]:
        """One optimizer step on this rank's prepared shard ``batch`` of the step ``step`` (all ranks call)."""
        prepared = time.perf_counter()
        routes = replay_routes(batch, self.config, self.num_layers, enabled=self.replay is not None)
        algo = self.cfg.algorithm
        inputs, correction = fwd.loss_inputs(batch, algo, device=self.device,
                                             max_response_tokens=self.cfg.rollout.agent.max_response_tokens,
                                             dp_group=self._dp_group)
        loss_fn = functools.partial(fwd.rl_loss, inputs=inputs, algo=algo)
        per_mb, batch_metrics = self.forward_backward(
            batch, loss_fn, entropy="grad" if algo.entropy_coef > 0 else "metric", routes=routes, step=step)
        backward_done = time.perf_counter()
        metrics = self.optimizer_step()
        done = time.perf_counter()
        metrics.update(self.reduce(per_mb))
        metrics.update(fwd.all_reduce_metrics(correction, contribute=self._reports) | batch_metrics)
        step_s = done - prepared
        metrics.update({
            "batch/num_tokens": float(step.num_tokens), "batch/num_sequences": float(len(step.seq_lens)),
            "perf/tokens_per_s": step.num_tokens / step_s,
            "timing/prepare_batch_s": prepare_s, "timing/forward_backward_s": backward_done - prepared,
            "timing/optimizer_s": done - backward_done, "timing/train_step_s": step_s,
        })
        return metrics

    # ------------------------------------------------------------------ weight sync, checkpoints
    def named_parameters_for_sync(self):
        """This rank's Megatron parameters under model-global names, for weight sync.

        Yields:
            ``(global_name, parameter)``: canonical checkpoint-style Megatron names with global
            layer and expert indices (`megarl.models.mapping.global_name`, the same under the local
            and Transformer Engine specs); the parameter itself, i.e. this rank's TP / ETP shard of
            the current weights (no copy; a view of the shard for a parameter the TE spec keeps
            whole on every TP rank: `megarl.models.params.iter_sync_params`).
        """
        from megarl.models.params import iter_sync_params
        from megarl.training.optimizer import gather_params

        gather_params(self.model_chunks)  # overlap_param_gather leaves the last step's all-gather pending
        yield from iter_sync_params(self.model_chunks, self.parallel, self.layout)

    @functools.cached_property
    def layout(self):
        """The model's `megarl.models.table.ModelLayout` (HF <-> Megatron mapping) at this TP size."""
        from megarl.models.families import get_family

        return get_family(self.hf_config).layout(self.hf_config, tp_size=self.parallel.tp_size)

    def save_checkpoint(self, directory: str) -> None:
        """Save model, optimizer, scheduler, RNG and step with ``dist_checkpointing`` (all ranks call)."""
        from megarl.training.checkpointing import save_trainer_state
        from megarl.training.optimizer import gather_params

        gather_params(self.model_chunks)  # see named_parameters_for_sync
        save_trainer_state(directory, self)

    def load_checkpoint(self, directory: str) -> None:
        """Load a checkpoint saved by `save_checkpoint`, possibly at another parallel layout."""
        from megarl.training.checkpointing import load_trainer_state

        load_trainer_state(directory, self)
