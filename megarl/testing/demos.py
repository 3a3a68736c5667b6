"""Test helper: run one of the examples' multi-seed learning demonstrations and read its summary."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_demo(script: str, out: Path, seeds: tuple[int, ...], timeout_s: float, *args: str) -> dict:
    """Run ``python SCRIPT --out OUT --seeds S1,S2 ARGS`` in the repository and return its
    ``summary.json`` (``{"runs": [{"seed", "before", "after", "steps", "wall_s"}], "summary"}``).

    Raises:
        AssertionError: the script failed (its output's tail in the message) or ran other seeds.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    proc = subprocess.run([sys.executable, script, "--out", str(out), "--seeds", ",".join(map(str, seeds)), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "summary.json").read_text())
    print((out / "summary.md").read_text())
    assert [run["seed"] for run in result["runs"]] == list(seeds)
    return result
