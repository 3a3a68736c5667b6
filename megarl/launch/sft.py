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


def demonstration_batches(trajectories: list, *, batch_size: int, num_steps: int, seed: int) -> Iterator[TrainBatch]:
    """``num_steps`` packed batches of ``batch_size`` demonstrations, in a seeded order."""
    from megarl.data.sampler import ResumableSampler

    sampler = ResumableSampler(len(trajectories), seed=seed)
    for _ in range(num_steps):
        chosen = [trajectories[i] for i in sampler.next_indices(batch_size)]
        yield TrainBatch.from_trajectories(chosen, torch.zeros(len(chosen)))


def prepare_demonstrations(cfg: MegarlConfig, dataset: Any) -> list:
    """The SFT demonstrations as trajectories (empty when ``sft.num_steps`` is 0); runs before Ray.

    Demonstrations are tokenised exactly as the agent loop lays out rollouts (same chat template,
    ``chat_template_kwargs``, system prompt and tool schemas; see :mod:`megarl.data.demonstrations`).

    Raises:
        ValueError: no usable demonstrations (names ``sft.demonstrations``).
    """
    from transformers import AutoTokenizer

    from megarl.data.demonstrations import demonstration_to_trajectory, load_demonstrations
    from megarl.rollout.template import build_template
    from megarl.rollout.tools import build_tools

    sft = cfg.sft
    if sft.num_steps <= 0:
        return []
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    tools = build_tools(dict(cfg.rollout.tools)) if cfg.rollout.agent.name != "single_turn" else {}
    template, _ = build_template(tokenizer, cfg.rollout.agent, tools)  # the rollouts' template and kwargs
    demos = load_demonstrations(sft.demonstrations, dataset.rows, system_prompt=cfg.rollout.agent.system_prompt,
                                tool_fraction=float(sft.tool_fraction), seed=int(cfg.train.seed),
                                limit=int(sft.max_demonstrations))
    return [demonstration_to_trajectory(tokenizer, m, template=template) for m in demos]


def run_cold_start(trainer: Any, sft: SFTConfig, trajectories: list, *, run_dir: Path, seed: int) -> bool:
    """Run ``sft.num_steps`` SFT steps on the trainer before RL (no-op without demonstrations).

    Progress goes to the log and to ``{run_dir}/sft_metrics.jsonl``.

    Args:
        trainer: the :class:`~megarl.launch.trainer_group.TrainerGroup`.
        sft: the ``sft`` section.
        trajectories: the demonstrations (:func:`prepare_demonstrations`).
        run_dir: the run directory.
        seed: ``train.seed`` (the order of the demonstrations).

    Returns:
        True when SFT ran (the trainer's weights then differ from the engines' launch weights).
    """
    import logging
    import time

    from megarl.launch.metric_sinks import JsonlSink

    if sft.num_steps <= 0 or not trajectories:
        return False
    log = logging.getLogger("megarl.train")
    log.info("SFT cold start: %d steps x %d of %d demonstrations (%s), lr %g", sft.num_steps, sft.batch_size,
             len(trajectories), sft.demonstrations, sft.lr)
    batches = demonstration_batches(trajectories, batch_size=int(sft.batch_size), num_steps=int(sft.num_steps),
                                    seed=int(seed))
    sink, start = JsonlSink(Path(run_dir) / "sft_metrics.jsonl"), time.perf_counter()
    try:
        for i, batch in enumerate(batches):
            metrics = trainer.sft_step(batch, lr=float(sft.lr))
            sink.log(i, metrics)
            if i % 20 == 0 or i == sft.num_steps - 1:
                log.info("SFT step %d/%d: nll %.4f, grad norm %.3f (%.0fs)", i + 1, sft.num_steps,
                         metrics["sft/nll"], metrics["sft/grad_norm"], time.perf_counter() - start)
    finally:
        sink.close()
    return True
