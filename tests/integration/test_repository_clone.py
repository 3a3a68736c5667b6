"""The repository stands on its own: a clone of HEAD into an empty directory validates every recipe,
and no tracked file names a path outside the repository.

Measured: ~15 s on an idle 2-core machine (one clone, one Python process validating every recipe).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Spelled in pieces so that this file does not match itself.
_OUTSIDE = re.compile("|".join([
    re.escape("../" + "shared"),
    re.escape("/" + "work/"),
    re.escape("shared" + "/data"),
    re.escape("shared" + "/notes"),
    r'"shared"\s*/',
    re.escape("DESIGN" + ".md"),
]))

_VALIDATE_ALL = r"""
import glob, sys
from pathlib import Path
from megarl.cli import main
from megarl.config import load_config

recipes = sorted(glob.glob("configs/*.yaml")) + sorted(glob.glob("examples/**/*.yaml", recursive=True))
assert len(recipes) >= 4, recipes
failed = []
for recipe in recipes:
    overrides = []
    hf_path = load_config(recipe, []).model.hf_path
    if not hf_path.startswith("tiny:") and not Path(hf_path).is_dir():
        # A model its example builds (examples/*/make_model.py): validate the rest on a tiny model.
        print(f"{recipe}: {hf_path} is built by its example; validating on tiny:qwen3_moe")
        overrides = ["model.hf_path=tiny:qwen3_moe"]
    if main(["validate", recipe, *overrides]) != 0:
        failed.append(recipe)
print("RECIPES", len(recipes), "FAILED", failed)
sys.exit(1 if failed else 0)
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """``git clone`` of the working tree's HEAD into an empty directory with nothing beside it."""
    dest = tmp_path_factory.mktemp("clone") / "megarl"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(dest)], check=True,
                   timeout=120)
    return dest


def test_no_tracked_file_names_a_path_outside_the_repository(clone):
    files = subprocess.run(["git", "ls-files"], cwd=clone, check=True, capture_output=True, text=True,
                           timeout=60).stdout.split()
    offenders = []
    for name in files:
        path = clone / name
        if path.suffix in (".jsonl", ".parquet", ".png", ".pt") or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), start=1):
            if _OUTSIDE.search(line):
                offenders.append(f"{name}:{lineno}: {line.strip()}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


@pytest.mark.timeout(300)
def test_every_recipe_validates_in_a_clone(clone, tmp_path):
    # The clone's own megarl package comes first on the path, not the installed one.
    env = dict(os.environ, PYTHONPATH=str(clone), MEGARL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("MEGARL_GSM8K_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _VALIDATE_ALL], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "FAILED []" in out
    assert out.count("OK ") >= 4
