"""StopGuard: stop signals and the wall-time budget end the run after the step in flight; the resume
file makes a second `megarl train` continue the first one's run directory."""
from __future__ import annotations

import os
import signal

import pytest

from megarl.launch.preemption import RESUME_FILE_ENV, StopGuard, record_run_dir, resume_overrides


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_wall_time_stops_before_a_step_that_would_not_fit():
    clock = Clock()
    guard = StopGuard(max_wall_time_s=100.0, clock=clock)
    clock.t = 30.0                       # setup + step 1 took 30 s: 30 + 30 <= 100
    assert guard.should_stop() is None
    clock.t = 60.0                       # step 2 took 30 s: 60 + 30 <= 100
    assert guard.should_stop() is None
    clock.t = 75.0                       # step 3 took 15 s: 75 + 15 <= 100
    assert guard.should_stop() is None
    clock.t = 95.0                       # step 4 took 20 s: 95 + 20 > 100
    reason = guard.should_stop()
    assert reason is not None and "train.max_wall_time_s=100" in reason
    assert StopGuard(None, clock=clock).should_stop() is None


def test_first_signal_asks_to_stop_second_stops_now():
    guard = StopGuard().install()
    try:
        assert guard.should_stop() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.should_stop() == "signal SIGUSR1"
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is not guard._on_signal


def test_resume_file_records_and_continues_the_run(tmp_path):
    env = {RESUME_FILE_ENV: str(tmp_path / "job" / "resume")}
    assert resume_overrides(env) == []                 # first start: nothing recorded yet
    record_run_dir("runs/x", env)
    recorded = (tmp_path / "job" / "resume").read_text().strip()
    assert os.path.isabs(recorded) and recorded.endswith("runs/x")
    assert resume_overrides(env) == [f"logging.run_dir={recorded}", "checkpoint.resume=true"]
    assert resume_overrides({}) == [] and record_run_dir("runs/y", {}) is None
