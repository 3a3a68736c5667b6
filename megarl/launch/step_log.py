"""The end of each RL step in the driver: ``perf/mfu``, the metric sinks, one console line, the saved
trajectories (``logging.save_rollouts``) and the progress bar (a terminal only)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable
from typing import Any

from megarl.launch.metric_sinks import MetricsLogger
from megarl.launch.mfu import MfuMeter
from megarl.launch.rollout_log import RolloutWriter

logger = logging.getLogger("megarl.train")


@dataclasses.dataclass
class StepLog:
    """Logs each RL step (module docstring)."""

    metrics: MetricsLogger
    """The run's metric sinks."""
    mfu: MfuMeter
    """``perf/mfu`` of a step (NaN: not logged)."""
    rollouts: RolloutWriter
    """Writes a step's trajectories (a disabled writer writes nothing)."""
    num_steps: int
    """``train.num_steps``."""
    first_step: int
    """Steps completed before the loop starts (a resumed run's)."""
    progress_bar: bool
    """``logging.progress_bar`` (shown only when stderr is a terminal)."""

    @functools.cached_property
    def progress(self) -> Any:
        """The step bar (tqdm), on stderr only when it is a terminal (a log file or pipe gets the step
        lines only); made on first use."""
        import sys

        from tqdm import tqdm

        return tqdm(total=self.num_steps, initial=self.first_step, desc="megarl", unit="step",
                    disable=not (self.progress_bar and sys.stderr.isatty()))

    def evaluation(self, metrics: dict[str, float], policy_version: int) -> dict[str, float]:
        """Log the evaluation before training (step 0); returns the logged floats."""
        logged = self.metrics.log(0, {**metrics, "policy_version": policy_version})
        logger.info("eval before training: %s", _fmt(logged, "eval/"))
        return logged

    def step(self, step: int, metrics: dict[str, float], groups: Iterable[Any], *, policy_version: int,
                 engine_weight_version: float) -> dict[str, float]:
        """Log RL step ``step`` (1-based, completed) with its trajectories ``groups``; returns the logged floats."""
        mfu = self.mfu.of_step(metrics, groups)
        if mfu == mfu:  # NaN (a CPU, an unknown GPU without logging.peak_tflops): not logged
            metrics["perf/mfu"] = mfu
        metrics["policy_version"] = float(policy_version)
        metrics.setdefault("engine/weight_version", engine_weight_version)
        logged = self.metrics.log(step, metrics)
        logger.info("step %d/%d | reward %.3f | engine weight_version %s | logprob mismatch: rollouts %s, "
                    "after sync %s | %s | %s%s", step, self.num_steps, logged.get("rollout/reward_mean", float("nan")),
                    _version_text(logged), _num(logged.get("mismatch/log_ratio_abs_mean")),
                    _num(logged.get("weight_sync/verify_logprob_diff_mean")),
                    _fmt(logged, "timing/", ("rollout_s", "logprobs_s", "train_s", "weight_sync_s")),
                    _fmt(logged, "perf/", ("tokens_per_s", "mfu")),
                    (" | " + _fmt(logged, "eval/")) if "eval/accuracy" in logged else "")
        self.rollouts.write(step, groups)
        self.progress.update(1)
        self.progress.set_postfix(reward=f"{logged.get('rollout/reward_mean', float('nan')):.3f}",
                                  version=policy_version)
        return logged

    def close(self) -> None:
        """End the progress bar, if one was made (the metric sinks are the run's to close)."""
        if "progress" in self.__dict__:
            self.progress.close()


def _version_text(m: dict[str, float]) -> str:
    v = m.get("engine/weight_version")
    return "?" if v is None or v != v else str(int(v))


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


def _fmt(m: dict[str, float], prefix: str, keys: tuple[str, ...] | None = None) -> str:
    names = keys or tuple(k[len(prefix):] for k in sorted(m) if k.startswith(prefix))
    return " ".join(f"{prefix}{k}={m[prefix + k]:.3g}" for k in names if prefix + k in m)
