"""The checkpoint stage of the RL loop: saves every ``checkpoint.save_interval`` steps and at the end,
resumes from the newest complete checkpoint, exports to Hugging Face in the background.

A checkpoint (layout: :mod:`megarl.launch.run_state`) gathers what the other stages own: the
trainer's weights and optimizer (every rank), the train stage's policy version, the rollout stage's
prompt order and (async) rollouts in flight, the driver's RNG states. Async mode: the rollouts in
flight are waited for and saved with the driver state (R3 routes as files, one Ray task per group:
:mod:`megarl.launch.route_files`), so a resumed run trains on exactly the same trajectories.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from megarl.config.schema import CheckpointConfig, ModelConfig
from megarl.launch import run_state as rs
from megarl.launch.hf_export import BackgroundExport
from megarl.launch.rollout_stage import RolloutStage
from megarl.launch.route_files import write_routes
from megarl.launch.train_stage import TrainStage

logger = logging.getLogger("megarl.train")


@dataclasses.dataclass
class CheckpointStage:
    """Saves and restores a run (module docstring)."""

    cfg: CheckpointConfig
    """The ``checkpoint`` section (``save_interval``, ``keep_last``, ``hf_export_interval``)."""
    model: ModelConfig
    """The ``model`` section (its HF config and tokenizer are copied into each checkpoint; an unset
    ``hf_path``, in stand-in runs, copies nothing)."""
    run_dir: Path
    """The run directory (``hf/step_*`` exports; checkpoints too unless ``save_dir`` is set)."""
    trainer: Any
    """The :class:`~megarl.launch.trainer_group.TrainerGroup`."""
    rollout: RolloutStage
    """The rollout stage (prompt order, rollouts in flight)."""
    train: TrainStage
    """The train stage (policy version)."""
    config_yaml: str
    """The resolved config, saved beside each driver state."""
    state: rs.RunState
    """The driver state resumed (or a fresh one); each save rewrites it (``wandb_id``, ``extra`` kept)."""
    hf_export: BackgroundExport = dataclasses.field(default_factory=BackgroundExport)
    """The HF export in flight (``checkpoint.hf_export_interval``)."""
    saved_step: int | None = None
    """The step of the last checkpoint saved or resumed (None: none yet)."""

    @property
    def save_dir(self) -> Path:
        """``checkpoint.save_dir`` or ``{run_dir}/checkpoints``."""
        return rs.save_dir_of(self.cfg, Path(self.run_dir))

    def restore(self, ckpt: Path) -> None:
        """Load checkpoint ``ckpt`` (its driver state is :attr:`state`) into the trainer and the stages."""
        logger.info("resuming from %s", ckpt)
        self.saved_step = self.state.step
        self.trainer.load_checkpoint(str(ckpt / rs.TRAINER_DIR))
        self.rollout.restore(self.state.sampler, self.state.pending_rollouts)
        self.train.policy_version = self.state.policy_version
        rs.restore_rng(self.state.rng)
        logger.info("resumed at step %d, policy version %d", self.state.step, self.state.policy_version)

    def after_step(self, step: int) -> None:
        """Save after ``step`` completed RL steps when ``checkpoint.save_interval`` says so."""
        every = int(self.cfg.save_interval)
        if every > 0 and step % every == 0:
            self.save(step)

    def finish(self, step: int) -> None:
        """Save at the end of the loop (the last step, or a stop) unless ``step`` is saved already."""
        if self.saved_step != step:
            self.save(step)

    def save(self, step: int) -> Path:
        """Save trainer (every rank) and driver state as ``step_{step}``; then mark it complete
        (:func:`~megarl.launch.run_state.commit_checkpoint`) and start its HF export when due."""
        ckpt = rs.step_dir(self.save_dir, step)
        start = time.perf_counter()
        self.trainer.save_checkpoint(str(ckpt / rs.TRAINER_DIR))
        rs.save_hf_metadata(ckpt, self.model.hf_path if _has_model(self.model) else None, self.model.tokenizer_path)
        self.state.step, self.state.policy_version = step, self.train.policy_version
        self.state.sampler, self.state.rng = self.rollout.sampler.state_dict(), rs.capture_rng()
        self.state.pending_rollouts = []
        for k, item in enumerate(self.rollout.in_flight):  # async: finished and saved with the state
            batch = item.wait()
            # R3 routes: references die with the session -> files, one task per group (route_files.py)
            self.state.pending_rollouts.append({"step": item.step, "rows": item.rows,
                                                "groups": write_routes(batch.groups, ckpt, f"p{k}"),
                                                "metrics": dict(batch.metrics), "policy_version": item.policy_version})
        rs.save_driver_state(ckpt, self.state, self.config_yaml)
        export_error = self.hf_export.wait(raise_error=False)  # the rotation below may delete what it reads
        rs.commit_checkpoint(self.save_dir, ckpt, int(self.cfg.keep_last))
        self.saved_step = step
        logger.info("checkpoint %s saved in %.1fs", ckpt, time.perf_counter() - start)
        if export_error is not None:  # logged and counted by the export; training goes on (hf_export.py)
            logger.error("HF export failed (%d so far): %r; training goes on", len(self.hf_export.failures),
                         export_error)
        every = int(self.cfg.hf_export_interval)
        if every > 0 and step % every == 0:
            self.hf_export.start(ckpt, self.run_dir / "hf" / ckpt.name)  # {run_dir}/hf/step_*, in the background
        return ckpt

    def wait_for_export(self) -> None:
        """Block until the HF export in flight (if any) is written; raise its error."""
        self.hf_export.wait()


def _has_model(model: ModelConfig) -> bool:
    """``model.hf_path`` is set (stand-in runs leave it missing)."""
    from omegaconf import OmegaConf

    return not (OmegaConf.is_config(model) and OmegaConf.is_missing(model, "hf_path"))
