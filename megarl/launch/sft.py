"""SFT cold start: masked negative log-likelihood on tool-use demonstrations, with the RL trainer.

As in ReTool (Feng et al. 2025, arXiv:2504.11536), a small policy first imitates demonstrations that
use the tool, so that RL starts from a policy that emits well-formed tool calls. The step runs on
the same Megatron model chunks, optimizer and micro-batch planner as the GSPO step; only the loss
differs:

    loss = - sum_t m_t * log p(x_t | x_<t) / sum_t m_t

over every trained token of the whole batch (all micro batches and data-parallel ranks: a token
mean), where ``m_t`` is the demonstration's ``loss_mask`` (1 on assistant tokens, 0 on the prompt,
tool observations and template tokens). Logits are not divided by the sampling temperature.
Deviation from ReTool: no separate SFT run or model; the optimizer's Adam state carries over into RL.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megarl.algorithms.metrics import sum_metric
from megarl.config.schema import MegarlConfig, SFTConfig
from megarl.training.batch import TrainBatch


@contextlib.contextmanager
def _learning_rate(optimizer: Any, lr: float) -> Iterator[None]:
    """Run with every param group at ``lr``; the scheduler's values are restored afterwards."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = lr
    try:
        yield
    finally:
        for group, value in zip(optimizer.param_groups, saved):
            group["lr"] = value


def sft_step(trainer: Any, batch: TrainBatch, *, lr: float) -> dict[str, float]:
    """One optimizer step of masked NLL (module docstring) on a rank's :class:`Trainer`.

    Every rank calls it with the same ``batch`` (``advantages`` are ignored); the trainer takes its
    data-parallel share.

    Args:
        trainer: this rank's :class:`megarl.training.trainer.Trainer`.
        batch: packed demonstrations, ``loss_mask`` ``[T_total]`` on assistant tokens.
        lr: learning rate of this step.

    Returns:
        ``sft/nll`` (token mean over the batch), ``sft/num_tokens``, ``sft/grad_norm``, identical
        on every rank.
    """
    mask_all = batch.loss_mask.to(trainer.device).float()
    total_tokens = mask_all.sum().clamp(min=1)

    def loss_fn(logprobs, _entropy, mb):
        if not mb.spec.seq_indices:  # padding-only micro batch: keep the graph, contribute nothing
            return logprobs.sum() * 0.0, {}
        mask = mask_all[mb.token_index]
        nll = -(logprobs * mask).sum() / total_tokens
        return nll, {"sft/nll": sum_metric(nll), "sft/num_tokens": sum_metric(mask.sum())}

    with _learning_rate(trainer.optimizer, lr):
        per_mb, _ = trainer.forward_backward(batch, loss_fn, temperature=1.0)
        _, grad_norm, _ = trainer.optimizer.step()  # no LR-scheduler step: SFT steps are not RL steps
    metrics = trainer.reduce(per_mb)
    metrics["sft/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    return metrics


@dataclasses.dataclass(frozen=True)
class ColdStart:
    """The SFT cold start, prepared before Ray (:func:`prepare_demonstrations`).

    Attributes:
        trajectories: the demonstrations, tokenised as the agent loop lays out rollouts.
        order: per SFT step, the indices into ``trajectories`` of its ``sft.batch_size``
            demonstrations (a seeded order, ``train.seed``; epochs reshuffled as the prompt sampler does).
        sft: the ``sft`` section (``lr``, ``num_steps``, ``demonstrations`` for the log).
    """

    trajectories: list
    order: list[list[int]]
    sft: SFTConfig

    def batches(self) -> Iterator[TrainBatch]:
        """The packed batch of each step, in :attr:`order` (``advantages`` zero: SFT ignores them)."""
        for indices in self.order:
            chosen = [self.trajectories[i] for i in indices]
            yield TrainBatch.from_trajectories(chosen, torch.zeros(len(chosen)))


def prepare_demonstrations(cfg: MegarlConfig, dataset: Any) -> ColdStart | None:
    """The SFT cold start: the demonstrations as trajectories and each step's choice of them (None
    when ``sft.num_steps`` is 0); runs before Ray.

    Demonstrations are tokenised exactly as the agent loop lays out rollouts (same chat template,
    ``chat_template_kwargs``, system prompt and tool schemas; see :mod:`megarl.data.demonstrations`).

    Raises:
        ValueError: no usable demonstrations (names ``sft.demonstrations``).
    """
    from transformers import AutoTokenizer

    from megarl.data.demonstrations import demonstration_to_trajectory, load_demonstrations
    from megarl.data.sampler import ResumableSampler
    from megarl.rollout.template import build_template
    from megarl.rollout.tools import build_tools

    sft = cfg.sft
    if sft.num_steps <= 0:
        return None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    tools = build_tools(dict(cfg.rollout.tools)) if cfg.rollout.agent.name != "single_turn" else {}
    template, _ = build_template(tokenizer, cfg.rollout.agent, tools)  # the rollouts' template and kwargs
    demos = load_demonstrations(sft.demonstrations, dataset.rows, system_prompt=cfg.rollout.agent.system_prompt,
                                tool_fraction=float(sft.tool_fraction), seed=int(cfg.train.seed),
                                limit=int(sft.max_demonstrations))
    trajectories = [demonstration_to_trajectory(tokenizer, m, template=template) for m in demos]
    sampler = ResumableSampler(len(trajectories), seed=int(cfg.train.seed)) if trajectories else None
    order = [sampler.next_indices(int(sft.batch_size)) for _ in range(int(sft.num_steps))] if sampler else []
    return ColdStart(trajectories=trajectories, order=order, sft=sft)


def run_cold_start(trainer: Any, cold_start: ColdStart | None, *, run_dir: Path) -> bool:
    """Run the prepared SFT steps on the trainer before RL (no-op without demonstrations).

    Progress goes to the log and to ``{run_dir}/sft_metrics.jsonl``.

    Args:
        trainer: the :class:`~megarl.launch.trainer_group.TrainerGroup`.
        cold_start: what :func:`prepare_demonstrations` returned.
        run_dir: the run directory.

    Returns:
        True when SFT ran (the trainer's weights then differ from the engines' launch weights).
    """
    import logging
    import time

    from megarl.launch.metric_sinks import JsonlSink

    if cold_start is None or not cold_start.trajectories or not cold_start.order:
        return False
    sft, log = cold_start.sft, logging.getLogger("megarl.train")
    num_steps = len(cold_start.order)
    log.info("SFT cold start: %d steps x %d of %d demonstrations (%s), lr %g", num_steps, sft.batch_size,
             len(cold_start.trajectories), sft.demonstrations, sft.lr)
    sink, start = JsonlSink(Path(run_dir) / "sft_metrics.jsonl"), time.perf_counter()
    try:
        for i, batch in enumerate(cold_start.batches()):
            metrics = trainer.sft_step(batch, lr=float(sft.lr))
            sink.log(i, metrics)
            if i % 20 == 0 or i == num_steps - 1:
                log.info("SFT step %d/%d: nll %.4f, grad norm %.3f (%.0fs)", i + 1, num_steps,
                         metrics["sft/nll"], metrics["sft/grad_norm"], time.perf_counter() - start)
    finally:
        sink.close()
    return True
