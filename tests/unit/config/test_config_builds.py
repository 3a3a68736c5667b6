"""A recipe whose path an example's script builds says which command builds it (issue 29 part 4):
examples/<name>/builds.txt maps built paths to commands, megarl validate names the command."""
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, load_config, validate
from megarl.config.builds import EXAMPLES_DIR, build_hint, read_manifests

REPO = Path(__file__).resolve().parents[3]


def test_every_manifest_command_runs_a_shipped_script_writing_its_path():
    manifests = read_manifests()
    assert "runs/arithmetic_demo/model" in manifests
    for built, (command, manifest) in manifests.items():
        words = command.split()
        assert words[0] == "python" and (REPO / words[1]).is_file(), (manifest, command)
        assert words[1].startswith(f"examples/{manifest.parent.name}/") and built in words, (manifest, command)


def test_every_example_recipe_path_under_runs_has_a_build_command():
    """Each example recipe's model path under runs/ is one a manifest builds."""
    for recipe in sorted(EXAMPLES_DIR.glob("*/*.yaml")):
        if recipe.name == "builds.txt":
            continue
        hf_path = (yaml.safe_load(recipe.read_text()).get("model") or {}).get("hf_path", "")
        if str(hf_path).startswith("runs/"):
            assert build_hint(hf_path), f"{recipe}: model.hf_path {hf_path} has no command in a builds.txt"


def test_build_hint_covers_the_path_and_files_under_it(tmp_path):
    (tmp_path / "examples" / "demo").mkdir(parents=True)
    manifest = tmp_path / "examples" / "demo" / "builds.txt"
    manifest.write_text("runs/demo/data: python examples/demo/make.py runs/demo/data\n")
    examples = tmp_path / "examples"
    hint = ("; build it first (from the repository root): python examples/demo/make.py runs/demo/data "
            "(examples/demo/builds.txt)")
    assert build_hint("runs/demo/data", examples) == hint
    assert build_hint("./runs/demo/data/train.jsonl", examples) == hint
    assert build_hint("runs/demo/database", examples) == "" and build_hint("runs/other", examples) == ""
    (tmp_path / "examples" / "demo" / "builds.txt").write_text("- not a mapping\n")
    assert build_hint("runs/demo/data", examples) == ""
    with pytest.raises(ValueError, match="builds.txt"):
        read_manifests(examples)


def test_validate_names_the_command_that_builds_a_missing_model(monkeypatch, tmp_path):
    """The arithmetic recipe run before make_model.py (from a directory where runs/ holds no model)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(load_config(REPO / "examples" / "arithmetic_tool" / "arithmetic_tool.yaml"))
    hf = [str(i) for i in err.value.issues if i.key == "model.hf_path"]
    assert hf and "python examples/arithmetic_tool/make_model.py runs/arithmetic_demo/model" in hf[0], err.value
    with pytest.raises(ConfigError) as err:  # a path no example builds: no command
        validate(load_config(REPO / "examples" / "arithmetic_tool" / "arithmetic_tool.yaml",
                             ["model.hf_path=/nonexistent/model"]))
    assert "build it first" not in str(err.value)
