"""``megarl.testing.demos.run_demo`` leaves nothing running when a demonstration times out.

Reference: the kernel's process table. A demonstration script starts ``megarl train`` runs, which
start Ray, engines and trainer ranks; a timed-out test that killed only the script left those
running (seen here: a killed demonstration test left its trainer ranks and engine busy for minutes).
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megarl.testing import demos

SCRIPT = """
import subprocess, sys, pathlib
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
pathlib.Path(sys.argv[sys.argv.index("--out") + 1], "child.pid").write_text(str(child.pid))
child.wait()
"""


@pytest.mark.timeout(60)
def test_a_timed_out_demonstration_leaves_no_process(tmp_path, monkeypatch):
    script = tmp_path / "demo.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(demos, "REPO", Path(tmp_path))
    with pytest.raises(subprocess.TimeoutExpired):
        demos.run_demo(str(script), out, (1,), 5.0)
    pid = int((out / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < deadline, f"the demonstration's child {pid} is still running"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """``pid`` is alive and not a zombie (it may be reaped between the two looks)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
