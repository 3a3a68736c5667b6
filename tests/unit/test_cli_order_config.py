"""The command line as users type it (issue 38 §2): options anywhere, the resolved config printed with
its sources, every problem reported at once, duplicate YAML keys refused, one precision spelling,
help texts without reST markup. ``megarl.cli.main`` runs in this process (nothing here starts Ray).
"""
import argparse

import pytest
import yaml

from megarl.cli import build_parser
from tests.unit.test_cli_bad_inputs import BASE, GPU, REPO, run_cli


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes' relative data paths
    monkeypatch.delenv("MEGARL_DEBUG", raising=False)


OVERRIDES = ["train.seed=3", "logging.run_dir=runs/fixed"]  # (the default run_dir holds the time)


@pytest.mark.parametrize("command,options", [
    ("plan", ["--gpu", "h100", "--no-sync"]), ("plan-sync", ["--gpu", "h100"]),
    ("validate", ["--cpu-scale"]), ("config", ["--sources"])])
def test_options_anywhere(command, options):
    """The reference is argparse's own reading with the options first; after and between the
    overrides must give the same exit status and output."""
    first = run_cli([command, BASE, *options, *OVERRIDES])
    assert first[0] in (0, 1), first[2]  # plan: 1 when the ranks do not fit
    for argv in ([command, BASE, *OVERRIDES, *options], [command, BASE, OVERRIDES[0], *options, OVERRIDES[1]]):
        assert run_cli(argv)[:2] == first[:2], argv


@pytest.mark.parametrize("command", ["train", "eval"])
def test_overrides_after_options_reach_the_config(command, tmp_path):
    """train / eval with an option first: the override after it is read (its typo is named), as
    with the option last; nothing starts (the config is refused)."""
    option = ["--cpu-scale"] if command == "train" else ["--hf", str(tmp_path)]
    (tmp_path / "config.json").write_text("{}")
    before = run_cli([command, BASE, "rollout.no_such_key=1", *option])
    after = run_cli([command, BASE, *option, "rollout.no_such_key=1"])
    assert before[0] == after[0] == 2 and "rollout.no_such_key" in after[2]


def test_config_prints_the_composed_config_with_sources(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {BASE}\n# a comment\nrollout:\n  group_size: 4\n")
    fixed = "logging.run_dir=runs/fixed"  # (the default run_dir holds the time)
    status, out, err = run_cli(["config", str(recipe), "train.seed=7", fixed, "--sources"])
    assert status == 0, err
    printed = yaml.safe_load(out)
    base = yaml.safe_load(open(BASE))
    assert printed["rollout"]["group_size"] == 4 and printed["train"]["seed"] == 7
    assert printed["model"]["moe_router_dtype"] == base["model"]["moe_router_dtype"]
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if "#" in line}
    file_line = recipe.read_text().splitlines().index("  group_size: 4") + 1
    assert lines["group_size"].endswith(f"# {recipe}:{file_line}")
    assert lines["seed"].endswith("# command line: train.seed=7")
    base_line = open(BASE).read().splitlines().index(next(
        line for line in open(BASE).read().splitlines() if line.strip().startswith("moe_router_dtype:"))) + 1
    assert lines["moe_router_dtype"].endswith(f"# {BASE}:{base_line}")
    assert lines["load_dir"].endswith("# default")
    assert yaml.safe_load(run_cli(["config", str(recipe), "train.seed=7", fixed])[1]) == printed  # without --sources


def test_validate_reports_a_typo_with_the_rules():
    status, _, err = run_cli(["validate", BASE, "rollout.no_such_key=1", "parallel.tensor_model_parallel_size=3"])
    assert status == 2
    assert "rollout.no_such_key" in err and "num_attention_heads" in err, err


def test_validate_reports_a_rule_with_the_memory_refusal():
    """TP1 with sequence_parallel=true is a rule's problem; EP1 at 30B does not fit an H100: both."""
    status, _, err = run_cli(["validate", GPU, "parallel.tensor_model_parallel_size=1",
                              "parallel.expert_model_parallel_size=1"])
    assert status == 2
    assert "parallel.sequence_parallel" in err and "80 GiB" in err, err


def test_duplicate_key_and_missing_extends_name_file_and_line(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(f"extends: {BASE}\nrollout:\n  group_size: 4\n  group_size: 8\n")
    status, _, err = run_cli(["validate", str(dup)])
    assert status == 2 and f"{dup}:4" in err and "first at line 3" in err, err
    ext = tmp_path / "ext.yaml"
    ext.write_text("# first line\nextends: nothere.yaml\n")
    status, _, err = run_cli(["config", str(ext)])
    assert status == 2 and f"{ext}:2" in err and str(tmp_path / "nothere.yaml") in err, err


def test_convert_directions_spell_precision_alike(capsys):
    from megarl.conversion.convert_cli import export_dtype

    parser = build_parser()
    new = parser.parse_args(["convert", "megatron-to-hf", "C", "O", "--precision", "bf16"])
    imp = parser.parse_args(["convert", "hf-to-megatron", "H", "O", "--precision", "bf16"])
    assert imp.precision == new.precision == "bf16" and export_dtype(new) == "bfloat16"
    old = parser.parse_args(["convert", "megatron-to-hf", "C", "O", "--dtype", "bfloat16"])
    assert export_dtype(old) == "bfloat16" and "deprecated" in capsys.readouterr().err


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_texts_without_rest_markup():
    for parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and ":func:" not in text and ":mod:" not in text, parser.prog
    status, out, _ = run_cli(["make-tiny-model", "--help"])
    assert status == 0 and out.startswith("usage: megarl make-tiny-model") and "``" not in out, out[:200]
