"""What the driver saves besides the trainer's weights, and the checkpoint directory layout.

::

    {save_dir}/
      step_000004/
        trainer/            the trainer's dist_checkpointing directory (Trainer.save, every rank)
          hf_config/        config.json, generation config, tokenizer: exportable without model.hf_path
        driver_state.pt     RunState: step, policy_version, sampler position, RNG states, pending rollouts
        config.yaml         the resolved config of the run that wrote it
      latest                "step_000004": written last, atomically -> marks a complete checkpoint

A run killed mid-save leaves a step directory without a ``latest`` pointing at it; resume uses the
previous complete one. Resume restores the sampler position and the driver's RNG states so the next
steps draw the same prompts and sampling seeds as an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.config.schema import CheckpointConfig

LATEST = "latest"
DRIVER_STATE = "driver_state.pt"
TRAINER_DIR = "trainer"
CONFIG_FILE = "config.yaml"


@dataclasses.dataclass
class RunState:
    """The driver's resumable state.

    Attributes:
        step: RL steps completed (the next step to run has this index).
        policy_version: trainer policy version (optimizer steps taken; engines hold this version
            after the sync that follows).
        sampler: :meth:`~megarl.data.sampler.ResumableSampler.state_dict` of the prompt sampler.
        rng: Python / NumPy / torch RNG states of the driver process (see :func:`capture_rng`).
        pending_rollouts: async mode: the rollouts generated but not yet trained on, oldest
            first, each ``{"step", "rows", "groups", "metrics", "policy_version"}`` (empty in sync
            mode). A checkpoint written before several could be in flight holds one, as
            ``pending_rollout``; :func:`load_driver_state` reads it into this list.
        wandb_id: W&B run id, so a resumed run appends to the same W&B run.
        extra: free-form (e.g. eval history).
    """

    step: int = 0
    policy_version: int = 0
    sampler: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    pending_rollouts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wandb_id: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """RNG states of this process: ``python``, ``numpy``, ``torch`` (CPU; ``cuda`` when available)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states saved by :func:`capture_rng` (missing entries are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(save_dir: str | Path, step: int) -> Path:
    """``{save_dir}/step_{step:06d}``."""
    return Path(save_dir) / f"step_{step:06d}"


def save_driver_state(ckpt_dir: Path, state: RunState, config_yaml: str) -> None:
    """Write ``driver_state.pt`` and ``config.yaml`` into ``ckpt_dir`` (created)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (DRIVER_STATE + ".tmp")
    # Shallow: dataclasses.asdict would also turn the saved in-flight TrajectoryGroups into dicts.
    torch.save({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, tmp)
    os.replace(tmp, ckpt_dir / DRIVER_STATE)
    (ckpt_dir / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")


def save_hf_metadata(ckpt_dir: Path, hf_path: str | None, tokenizer_path: str | None = None) -> Path | None:
    """Copy the model's HF config, generation config and tokenizer (every non-weight file of
    ``hf_path``, then ``tokenizer_path``'s when set) into ``ckpt_dir/trainer/hf_config``, so that
    ``megarl convert megatron-to-hf ckpt_dir OUT`` needs no ``--hf-config``.

    Returns:
        The directory written, or None when ``hf_path`` is not an HF directory (runs without a model).
    """
    from megarl.conversion.convert import HF_CONFIG_SUBDIR, copy_hf_metadata

    if not hf_path or not (Path(hf_path) / "config.json").is_file():
        return None
    out = ckpt_dir / TRAINER_DIR / HF_CONFIG_SUBDIR
    copy_hf_metadata(Path(hf_path), out)
    if tokenizer_path and Path(tokenizer_path).is_dir():
        copy_hf_metadata(Path(tokenizer_path), out)
    return out


def commit_checkpoint(save_dir: str | Path, ckpt_dir: Path, keep_last: int) -> None:
    """Point ``latest`` at ``ckpt_dir`` (atomic rename), then delete all but the newest ``keep_last``.

    Call only after the trainer and driver state are fully written.
    """
    save_dir = Path(save_dir)
    tmp = save_dir / (LATEST + ".tmp")
    tmp.write_text(ckpt_dir.name, encoding="utf-8")
    os.replace(tmp, save_dir / LATEST)
    if keep_last > 0:
        complete = sorted(p for p in save_dir.glob("step_*") if (p / DRIVER_STATE).is_file())
        for old in complete[:-keep_last]:
            if old != ckpt_dir:
                shutil.rmtree(old, ignore_errors=True)


def find_latest(save_dir: str | Path) -> Path | None:
    """The checkpoint named by ``{save_dir}/latest``, or None when there is none.

    Raises:
        FileNotFoundError: ``latest`` names a directory that is gone or incomplete.
    """
    pointer = Path(save_dir) / LATEST
    if not pointer.is_file():
        return None
    ckpt = Path(save_dir) / pointer.read_text(encoding="utf-8").strip()
    if not (ckpt / DRIVER_STATE).is_file():
        raise FileNotFoundError(f"{pointer} names {ckpt}, which has no {DRIVER_STATE}")
    return ckpt


def load_driver_state(ckpt_dir: Path) -> RunState:
    """Read ``driver_state.pt`` of a checkpoint."""
    # weights_only=False: the state holds RNG tuples and TrajectoryGroups written by this program.
    data = torch.load(ckpt_dir / DRIVER_STATE, weights_only=False)
    single = data.pop("pending_rollout", None)  # checkpoints of megarl <= 0.2: one in flight
    if single:
        data["pending_rollouts"] = [single]
    return RunState(**data)


def save_dir_of(checkpoint: CheckpointConfig, run_dir: Path) -> Path:
    """``checkpoint.save_dir`` or ``{run_dir}/checkpoints``."""
    return Path(checkpoint.save_dir) if checkpoint.save_dir else run_dir / "checkpoints"


def find_resume(checkpoint: CheckpointConfig, run_dir: Path) -> tuple[Path | None, RunState]:
    """The checkpoint to resume (``checkpoint.resume``: the newest complete one, else None) and its
    driver state (a fresh :class:`RunState` without one); read before Ray starts.

    Raises:
        FileNotFoundError: ``latest`` names a directory that is gone or incomplete.
    """
    if not checkpoint.resume:
        return None, RunState()
    save_dir = save_dir_of(checkpoint, run_dir)
    latest = find_latest(save_dir)
    return latest, load_driver_state(latest) if latest is not None else RunState()
