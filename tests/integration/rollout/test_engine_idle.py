"""An idle SGLang CPU server leaves the host's cores to the trainer (``rollout.engine.sleep_on_idle``).

Reference: the kernel's CPU-time accounting of the server's scheduler process (``psutil``), over a
window in which nothing is sent to it. Without ``--sleep-on-idle`` SGLang 0.5.23's scheduler loop
polls its sockets without blocking and was measured here at 70-95% of a core for a server idle for
minutes (the shared test engines ran so through the whole suite).
"""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from megarl.testing.engine_state import wait_idle

IDLE_WINDOW_S = 6.0
MAX_IDLE_CORE_FRACTION = 0.2


def _scheduler(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "scheduler" in child.name():
            return child
    raise AssertionError(f"no sglang::scheduler process under {pid}")


@pytest.mark.timeout(600)  # includes the shared engine's start when this test is the first to use it
def test_idle_engine_scheduler_does_not_spin(sglang_engine):
    assert "--sleep-on-idle" in sglang_engine.command()
    scheduler = _scheduler(sglang_engine.pid)
    asyncio.run(wait_idle(sglang_engine.url))  # a request of an earlier test has drained
    before = scheduler.cpu_times()
    time.sleep(IDLE_WINDOW_S)
    after = scheduler.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used / IDLE_WINDOW_S < MAX_IDLE_CORE_FRACTION, f"idle scheduler used {used:.2f} s CPU in {IDLE_WINDOW_S} s"
