"""The stages the RL loop calls, built on a run's started processes.

:func:`build_stages` takes what :class:`megarl.launch.run.Run` started (:class:`Started`: engines,
memory loan, trainer ranks, rollout actor, metric sinks) and the run's data, and returns
:class:`Stages`: one object per stage, each owning its state, which
:func:`megarl.launch.driver.run_loop` calls in turn. Nothing here starts or stops a process.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from megarl.cluster.colocated import EngineMemoryLoan
from megarl.cluster.ray_engines import EngineGroup, heal_engines
from megarl.config.schema import MegarlConfig
from megarl.data.datasets import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.launch.advantage_stage import AdvantageStage
from megarl.launch.checkpoint_stage import CheckpointStage
from megarl.launch.eval_stage import EvalStage
from megarl.launch.metric_sinks import MetricsLogger
from megarl.launch.pipeline import pipeline_depth, staleness_bound
from megarl.launch.rollout_stage import RolloutStage
from megarl.launch.run_state import RunState
from megarl.launch.step_log import StepLog
from megarl.launch.train_stage import TrainStage
from megarl.launch.trainer_group import TrainerGroup
from megarl.launch.weight_sync_stage import NUM_PROBES, WeightSyncStage


@dataclasses.dataclass
class Stages:
    """What the RL loop (:func:`megarl.launch.driver.run_loop`) calls, one call per stage, each
    owning its state; the loop holds nothing but the step."""

    rollout: RolloutStage
    advantages: AdvantageStage
    train: TrainStage
    sync: WeightSyncStage
    evaluation: EvalStage
    checkpoint: CheckpointStage
    log: StepLog
    num_steps: int
    """``train.num_steps``."""
    first_step: int = 0
    """RL steps completed before the loop starts (a resumed checkpoint's)."""


@dataclasses.dataclass(frozen=True)
class Started:
    """The processes and sinks a run started that the stages use (see :class:`megarl.launch.run.Run`)."""

    run_dir: Path
    engines: EngineGroup
    engine_urls: list[str]
    loan: EngineMemoryLoan
    """Colocated: the engines' memory lent to the trainer (:mod:`megarl.cluster.colocated`)."""
    trainer: TrainerGroup
    rollout_actor: Any
    """The :class:`~megarl.launch.rollout_actor.RolloutWorker` actor handle."""
    metrics: MetricsLogger
    on_cuda: bool
    """Whether the trainer ranks run on CUDA devices (the placement's answer)."""


def build_stages(cfg: MegarlConfig, started: Started, dataset: PromptDataset, eval_rows: list[dict] | None,
                 state: RunState) -> Stages:
    """The stages on ``started`` (``state``: the driver state resumed, or a fresh one)."""
    num_steps, ro, every = int(cfg.train.num_steps), cfg.rollout, int(cfg.weight_sync.every_n_steps)
    actor = started.rollout_actor
    sync = WeightSyncStage(cfg=cfg.weight_sync, train_cfg=cfg.train, model=cfg.model, trainer=started.trainer,
                           engine_urls=started.engine_urls, rollout_actor=actor,
                           directory=started.run_dir / "weight_sync",
                           probe_prompts=[dataset.prompt(i) for i in range(min(NUM_PROBES, len(dataset)))])
    rollout = RolloutStage(rollout=ro, dataset=dataset, rollout_actor=actor, num_steps=num_steps,
                           sampler=ResumableSampler(len(dataset), seed=int(cfg.train.seed),
                                                    shuffle=bool(cfg.data.shuffle)),
                           depth=pipeline_depth(ro.async_mode, ro.max_staleness, every), sync=sync,
                           heal=functools.partial(heal_engines, started.engines, actor, sync))
    train = TrainStage(trainer=started.trainer, loan=started.loan, global_batch_size=int(cfg.train.global_batch_size))
    return Stages(
        rollout=rollout,
        advantages=AdvantageStage(cfg.algorithm, staleness_bound(ro.async_mode, ro.max_staleness, every)),
        train=train,
        sync=sync,
        evaluation=EvalStage(rows=eval_rows, rollout_actor=actor, interval=int(cfg.data.eval_interval),
                             num_steps=num_steps),
        checkpoint=CheckpointStage(cfg=cfg.checkpoint, model=cfg.model, run_dir=started.run_dir,
                                   trainer=started.trainer, rollout=rollout, train=train,
                                   config_yaml=OmegaConf.to_yaml(cfg, resolve=True), state=state),
        log=build_step_log(cfg, started, state.step),
        num_steps=num_steps,
        first_step=state.step)


def build_step_log(cfg: MegarlConfig, started: Started, first_step: int) -> StepLog:
    """The step log: metric sinks, ``perf/mfu``, the saved trajectories, the progress bar."""
    from megarl.config.parallel import trainer_world_size
    from megarl.launch.mfu import MfuMeter
    from megarl.launch.rollout_log import RolloutWriter

    model_dir = None if OmegaConf.is_missing(cfg.model, "hf_path") else str(cfg.model.hf_path)
    return StepLog(metrics=started.metrics,
                   mfu=MfuMeter(model_dir=model_dir, num_devices=trainer_world_size(cfg.cluster),
                                on_cuda=started.on_cuda, peak_tflops=cfg.logging.peak_tflops),
                   rollouts=RolloutWriter(run_dir=started.run_dir, tokenizer_path=cfg.model.tokenizer_path or model_dir,
                                          prompt_key=cfg.data.prompt_key, enabled=cfg.logging.save_rollouts),
                   num_steps=int(cfg.train.num_steps), first_step=first_step, progress_bar=cfg.logging.progress_bar)
