"""Metric sinks of a run: TensorBoard (default), JSON lines, Weights & Biases; stage timers; PNG curves.

Metric keys are ``section/name`` (``rollout/reward_mean``, ``timing/train_s``, ``mismatch/...``).
Values reach the sinks already reduced: the trainer reduces its :class:`~megarl.algorithms.metrics.Metric`
values over micro batches and ranks, and rollout statistics are computed on the whole step here.
``metrics.jsonl`` holds one object per RL step, ``{"step": k, "policy_version": v, key: value, ...}``;
the PNG curves are drawn from that file at the end of the run, so they can be re-drawn after a crash.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REWARD_KEYS = ("rollout/reward_mean", "eval/accuracy")
"""Curves drawn in ``reward.png`` (those present in the log)."""
MISMATCH_KEYS = ("mismatch/log_ratio_abs_mean",)
"""Curves drawn in ``mismatch.png``: mean |trainer - engine| logprob over trained tokens."""


def to_float(value: Any) -> float:
    """A plain float from a float, int, 0-dim tensor or :class:`~megarl.algorithms.metrics.Metric`."""
    value = getattr(value, "value", value)  # Metric -> its reduced value
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class JsonlSink:
    """Appends one JSON object per step to ``{run_dir}/metrics.jsonl`` (flushed every line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one line ``{"step": step, **metrics}`` and flush (NaN / inf written as JSON's
        ``NaN`` / ``Infinity``).
        """
        self._file.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardSink:
    """Scalars to TensorBoard event files under ``{run_dir}/tensorboard``."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write each finite metric as a scalar at ``global_step=step`` (NaN / inf are skipped:
        TensorBoard cannot plot them) and flush.
        """
        for key, value in metrics.items():
            if math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbSink:
    """Weights & Biases run (``pip install wandb``).

    Raises:
        ImportError: wandb is not installed (raised at construction, i.e. before training starts).
    """

    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any], resume_id: str | None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logging.wandb=true needs the wandb package: pip install wandb") from e
        self._run = wandb.init(project=project, dir=str(run_dir), config=dict(config),
                               id=resume_id, resume="allow" if resume_id else None)
        self.run_id = self._run.id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` to the W&B run at ``step``."""
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the W&B run (uploads what is pending)."""
        self._run.finish()


class MetricsLogger:
    """Fan-out of per-step metrics to the enabled sinks.

    Args:
        run_dir: the run directory.
        tensorboard, jsonl: enable those sinks.
        wandb: enable W&B (``wandb_project``, ``config`` logged with the run).
        config: the resolved config as a plain dict (for W&B).
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, jsonl: bool = True,
                 wandb: bool = False, wandb_project: str = "megarl",
                 config: Mapping[str, Any] | None = None, wandb_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.sinks: list[Any] = []
        if jsonl:
            self.sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
        if tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        self.wandb_id = None
        if wandb:
            sink = WandbSink(wandb_project, self.run_dir, config or {}, wandb_id)
            self.wandb_id = sink.run_id
            self.sinks.append(sink)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Log one step's metrics (values converted with :func:`to_float`); returns the floats."""
        floats = {k: to_float(v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.log(step, floats)
        return floats

    def close(self) -> None:
        """Flush and close every sink."""
        for sink in self.sinks:
            sink.close()


class StageTimer:
    """Wall-clock time per stage of one step, as ``timing/{stage}_s`` metrics.

    Example::

        timer = StageTimer()
        with timer("rollout"):
            groups = manager.generate(...)
        metrics.update(timer.metrics())
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``{"timing/{stage}_s": seconds}`` for every stage timed, plus ``timing/step_s`` (their sum)."""
        out = {f"timing/{k}_s": v for k, v in self._seconds.items()}
        out["timing/step_s"] = sum(self._seconds.values())
        return out


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl`` (the last row wins when a resumed run re-logged a step)."""
    by_step: dict[int, dict[str, float]] = {}
    p = Path(path)
    if not p.is_file():
        return []
    with open(p, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


def save_plots(run_dir: str | Path) -> list[Path]:
    """Draw ``reward.png`` and ``mismatch.png`` in ``run_dir`` from its ``metrics.jsonl``.

    Returns:
        The PNG files written (a plot with no data to show is skipped).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    written = []
    for name, keys, ylabel in (("reward.png", REWARD_KEYS, "reward / accuracy"),
                               ("mismatch.png", MISMATCH_KEYS, "|logprob trainer - engine|")):
        series = {k: [(r["step"], r[k]) for r in rows if k in r and math.isfinite(r[k])] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            logger.warning("no data for %s (keys %s)", name, ", ".join(keys))
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        written.append(run_dir / name)
    return written
