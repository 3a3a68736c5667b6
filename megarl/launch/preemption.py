"""Stopping a run early and cleanly: scheduler signals, a wall-time budget, and resuming afterwards.

A batch scheduler ends jobs: Slurm sends ``SIGUSR1`` a chosen time before the limit
(``#SBATCH --signal=B:USR1@600``), ``SIGTERM`` on preemption or ``scancel``, then ``SIGKILL``.
:class:`StopGuard` turns the first ``SIGUSR1`` / ``SIGTERM`` into a request: the driver finishes
the RL step in flight, saves a checkpoint, shuts its processes down and exits with
:data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: try again later), which tells a wrapper (``slurm/train.sbatch``) to requeue
the job. A
second signal stops at once (``KeyboardInterrupt``; the run resumes from the previous checkpoint).
``train.max_wall_time_s`` does the same without a scheduler: the guard stops after the step whose
successor would end past the budget (predicted from the last step's duration, evaluation and
checkpointing included); leave room for one checkpoint save.

Resuming without flags: when ``MEGARL_RESUME_FILE`` names a file, ``megarl train`` writes the run
directory into it; a later ``megarl train`` with the same variable (a requeued Slurm job: the same
job id) finds it and continues that run (``logging.run_dir`` = the recorded one,
``checkpoint.resume=true``) from its newest complete checkpoint.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("megarl.train")

EXIT_PREEMPTED = 75
"""Exit status of ``megarl train`` after a clean early stop (checkpoint saved; resume to continue)."""

RESUME_FILE_ENV = "MEGARL_RESUME_FILE"
"""Environment variable naming the file that records the run directory (see the module docstring)."""

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """The run stopped early on request, after saving a checkpoint at ``step``."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(f"stopped after step {step}: {reason}; checkpoint saved, resume to continue")
        self.reason = reason
        self.step = step


class StopGuard:
    """Decides, between RL steps, whether the run must stop now.

    Args:
        max_wall_time_s: budget of the whole command in seconds (None = none).
        clock: monotonic clock (tests pass their own).
    """

    def __init__(self, max_wall_time_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wall_time_s = max_wall_time_s
        self.clock = clock
        self.start = self._last = clock()
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopGuard:
        """Handle ``SIGUSR1`` / ``SIGTERM`` (main thread only; elsewhere signals are left alone)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and self.reason.startswith("signal"):
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping now")
        self.reason = f"signal {name}"
        logger.warning("received %s: finishing the step in flight, then saving a checkpoint and exiting "
                       "(send it again to stop at once)", name)

    def should_stop(self) -> str | None:
        """Called after each step: the reason to stop now, or None to go on."""
        now = self.clock()
        step_s, self._last = now - self._last, now
        if self.reason is None and self.max_wall_time_s is not None:
            if now - self.start + step_s > self.max_wall_time_s:
                self.reason = (f"train.max_wall_time_s={self.max_wall_time_s:g}: {now - self.start:.0f} s used, "
                               f"the next step would take about {step_s:.0f} s")
        return self.reason


def resume_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """Overrides that continue the run recorded in ``$MEGARL_RESUME_FILE`` ([] when none is)."""
    path = (environ if environ is not None else os.environ).get(RESUME_FILE_ENV)
    if not path or not Path(path).is_file():
        return []
    run_dir = Path(path).read_text(encoding="utf-8").strip()
    if not run_dir:
        return []
    logger.info("%s=%s: continuing the run in %s", RESUME_FILE_ENV, path, run_dir)
    return [f"logging.run_dir={run_dir}", "checkpoint.resume=true"]


def record_run_dir(run_dir: str, environ: dict[str, str] | None = None) -> None:
    """Write ``run_dir`` (absolute) into ``$MEGARL_RESUME_FILE`` when it is set (atomically)."""
    path = (environ if environ is not None else os.environ).get(RESUME_FILE_ENV)
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(str(Path(run_dir).resolve()) + "\n", encoding="utf-8")
    os.replace(tmp, target)
