"""Expected errors at the ``megarl`` command line (issue 29 §5): one line on stderr, a non-zero exit,
no traceback; ``--debug`` / ``MEGARL_DEBUG=1`` add the traceback.

Each kind runs the installed CLI in a subprocess: a config key that does not exist, a truncated
safetensors shard and a ``config.json`` that disagrees with the weights given to
``megarl convert hf-to-megatron``. The reference for "the right error" is the exception class the
library raises for the same input (``megarl.conversion``'s own reader and checker), named in the line.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def megarl(*args, env=None, timeout=240):
    env = {**{k: v for k, v in os.environ.items() if k != "MEGARL_DEBUG"}, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def stderr_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def broken_checkpoints(tiny_dense_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    trunc = root / "trunc"
    shutil.copytree(tiny_dense_dir, trunc)
    shard = trunc / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    deeper = root / "deeper"
    shutil.copytree(tiny_dense_dir, deeper)
    cfg = json.loads((deeper / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # the weights hold one layer fewer than config.json says
    cfg.pop("layer_types", None)  # (transformers would refuse a layer_types list of the old length first)
    (deeper / "config.json").write_text(json.dumps(cfg))
    return {"truncated": trunc, "mismatch": deeper}


def library_error(hf_dir, tmp_path):
    """The exception the converter itself raises for ``hf_dir`` (the reference)."""
    from megarl.conversion.convert import hf_to_megatron

    with pytest.raises(Exception) as info:
        hf_to_megatron(hf_dir, tmp_path / "ref_out")
    return info.value


def cases(broken, tmp_path):
    return {
        "config": (["validate", "configs/base.yaml", "rollout.no_such_key=1"], "rollout.no_such_key"),
        "truncated": (["convert", "hf-to-megatron", str(broken["truncated"]), str(tmp_path / "out_t")],
                      "truncated checkpoint shard"),
        "mismatch": (["convert", "hf-to-megatron", str(broken["mismatch"]), str(tmp_path / "out_m")],
                     "num_hidden_layers"),
    }


@pytest.mark.slow  # two CLI processes per kind (~20 s each on a shared CPU)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["config", "truncated", "mismatch"])
def test_expected_error_is_one_line(kind, broken_checkpoints, tmp_path):
    args, needle = cases(broken_checkpoints, tmp_path)[kind]
    proc = megarl(*args)
    lines = stderr_lines(proc)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"megarl {args[0]}: ") and needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    if kind == "config":  # the loader's own error for the same overrides
        from megarl.config import ConfigError, load_config

        with pytest.raises(ConfigError) as info:
            load_config(REPO / "configs" / "base.yaml", ["rollout.no_such_key=1"])
        ref = info.value
        assert ref.issues[0].key in lines[0]
    else:  # the line is the library's own message for the same input
        ref = library_error(broken_checkpoints[kind], tmp_path)
        assert str(ref).splitlines()[0].strip() in lines[0]
        assert not (tmp_path / "out_t").exists() and not (tmp_path / "out_m").exists()
    # The traceback on request: the flag, or (for the truncated shard) the environment variable.
    debug = megarl(*args, env={"MEGARL_DEBUG": "1"}) if kind == "truncated" else megarl(*args, "--debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
    assert type(ref).__name__ in debug.stderr
    assert stderr_lines(debug)[-1] == lines[0]
