"""Test helper: run one of the examples' multi-seed learning demonstrations and read its summary."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_demo(script: str, out: Path, seeds: tuple[int, ...], timeout_s: float, *args: str) -> dict:
    """Run ``python SCRIPT --out OUT --seeds S1,S2 ARGS`` in the repository and return its
    ``summary.json`` (``{"runs": [{"seed", "before", "after", "steps", "wall_s"}], "summary"}``).

    The script runs in its own process group, which is killed when this call ends however it ends
    (a timeout, or the test interrupted): what its ``megarl train`` runs leave (Ray, engines, trainer
    ranks) would otherwise keep the machine's cores from the tests that follow.

    Raises:
        AssertionError: the script failed (its output's tail in the message) or ran other seeds.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    proc = subprocess.Popen([sys.executable, script, "--out", str(out), "--seeds", ",".join(map(str, seeds)), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    result = json.loads((out / "summary.json").read_text())
    print((out / "summary.md").read_text())
    assert [run["seed"] for run in result["runs"]] == list(seeds)
    return result
