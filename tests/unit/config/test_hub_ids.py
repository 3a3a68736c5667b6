"""Hub ids as model paths (issue 29 §2): ``org/name[@revision]`` resolved through huggingface_hub's
cache, offline, with a clear error naming the key when the model is not cached.

The reference is the cache layout itself, built here as huggingface_hub documents it
(``models--org--name/snapshots/<commit>/`` and ``refs/<branch or tag>`` holding the commit) in a
temporary ``HF_HOME``, with a tiny model's files in the snapshot; no network is used.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError
from megarl.config.hub import parse_hub_id, resolve_hub_path

REPO = Path(__file__).resolve().parents[3]
MAIN, TAGGED = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hf_home(tiny_dense_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--megarl-test--tiny-qwen3"
    for commit in (MAIN, TAGGED):
        shutil.copytree(tiny_dense_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(TAGGED)
    return home


@pytest.fixture()
def offline_cache(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home / "hub" / "models--megarl-test--tiny-qwen3" / "snapshots"


def test_parse_hub_id(tmp_path, monkeypatch):
    assert parse_hub_id("Qwen/Qwen3-30B-A3B") == ("Qwen/Qwen3-30B-A3B", None)
    assert parse_hub_id("deepseek-ai/DeepSeek-V3.1@main") == ("deepseek-ai/DeepSeek-V3.1", "main")
    for path in ("/models/x", "./a/b", "~/m/x", "tiny:qwen3_moe", "a/b/c", "x"):
        assert parse_hub_id(path) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None  # an existing relative directory wins


def test_resolves_branch_tag_and_commit_from_the_cache(offline_cache):
    assert Path(resolve_hub_path("megarl-test/tiny-qwen3", "model.hf_path")) == offline_cache / MAIN
    assert Path(resolve_hub_path("megarl-test/tiny-qwen3@v1", "model.hf_path")) == offline_cache / TAGGED
    assert Path(resolve_hub_path(f"megarl-test/tiny-qwen3@{TAGGED}", "model.hf_path")) == offline_cache / TAGGED
    assert resolve_hub_path("/some/dir", "model.hf_path") == "/some/dir"  # not a hub id: unchanged


def test_offline_and_not_cached_names_the_key(offline_cache):
    with pytest.raises(ConfigError, match=r"model.tokenizer_path='megarl-test/absent'.*not a local directory, and as a hub id not in the cache .*"
                                          r"HF_HUB_OFFLINE is set"):
        resolve_hub_path("megarl-test/absent", "model.tokenizer_path")
    with pytest.raises(ConfigError, match="model.hf_path"):
        resolve_hub_path("megarl-test/tiny-qwen3@v9", "model.hf_path")  # a revision the cache lacks


@pytest.mark.slow  # two CLI processes (~30 s each on a shared CPU)
@pytest.mark.timeout(300)
def test_megarl_validate_with_a_hub_id(hf_home):
    """The CLI as a user runs it: HF_HOME and HF_HUB_OFFLINE in the environment; a cached id is
    accepted, a missing one is one line naming model.hf_path."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    common = ["validate", "configs/base.yaml", f"data.train_path={REPO / 'data' / 'gsm8k' / 'train.jsonl'}",
              "data.eval_path=null", "cluster.device=cpu", "train.precision=fp32", "train.global_batch_size=16",
              "rollout.num_prompts_per_step=4", "rollout.group_size=4"]
    ok = subprocess.run([sys.executable, "-m", "megarl.cli", *common, "model.hf_path=megarl-test/tiny-qwen3@v1",
                         "model.tokenizer_path=megarl-test/tiny-qwen3"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=240)
    assert ok.returncode == 0 and ok.stdout.startswith("OK configs/base.yaml: model Qwen3ForCausalLM"), ok.stderr
    missing = subprocess.run([sys.executable, "-m", "megarl.cli", *common, "model.hf_path=Qwen/Qwen3-30B-A3B"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in missing.stderr.splitlines() if line.strip()]
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "model.hf_path='Qwen/Qwen3-30B-A3B'" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


@pytest.mark.slow  # a conversion of the tiny model (~1-3 min on a shared CPU)
@pytest.mark.timeout(400)
def test_megarl_convert_takes_a_hub_id(offline_cache, tmp_path, capsys):
    from megarl.cli import main as cli_main

    assert cli_main(["convert", "hf-to-megatron", "megarl-test/tiny-qwen3@v1", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "hf_config" / "config.json").read_text() == (offline_cache / TAGGED / "config.json").read_text()
    assert cli_main(["convert", "hf-to-megatron", "megarl-test/absent", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megarl convert: invalid configuration") and "HF_DIR='megarl-test/absent'" in err[-1]
    assert not (tmp_path / "none").exists()
