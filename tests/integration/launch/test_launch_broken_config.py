"""A broken run fails before any Ray actor (or Ray itself) starts, naming what is wrong."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MEGARL = str(Path(sys.executable).parent / "megarl")


def _train(tmp_path, *overrides):
    start = time.monotonic()
    proc = subprocess.run([MEGARL, "train", "configs/cpu_gsm8k.yaml", f"logging.run_dir={tmp_path / 'run'}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.timeout(300)
@pytest.mark.parametrize("override, names", [
    ("parallel.expert_model_parallel_size=3", "parallel.expert_model_parallel_size"),  # cross-field (validate)
    ("sft.demonstrations=missing_builder", "sft.demonstrations"),                       # unknown builder (validate)
    ("sft.demonstrations=runs/missing/demos.jsonl", "sft.demonstrations"),              # missing file (the driver)
])
def test_broken_config_fails_before_ray(tmp_path, override, names):
    code, out, wall_s = _train(tmp_path, override)
    assert code != 0
    assert names in out
    assert "starting a local Ray instance" not in out and "trainer group" not in out


@pytest.mark.timeout(300)
def test_bad_dataset_line_fails_before_ray(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": oops}\n')
    code, out, _ = _train(tmp_path, f"data.train_path={data}", "data.eval_path=null")
    assert code != 0 and f"{data}:2" in out
    assert "starting a local Ray instance" not in out
