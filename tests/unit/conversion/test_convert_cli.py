"""``megarl convert`` and tools/convert_*.py take the same flags, with the same defaults, types and
choices, and expose every option of the converter functions they call."""
import argparse
import importlib.util
import inspect
from pathlib import Path

import pytest

from megarl.cli import build_parser
from megarl.conversion import convert

TOOLS = Path(__file__).resolve().parents[3] / "tools"
DIRECTIONS = {  # megarl convert <direction>: (tool, converter function)
    "hf-to-megatron": ("convert_hf_to_megatron", convert.hf_to_megatron),
    "megatron-to-hf": ("convert_megatron_to_hf", convert.megatron_to_hf_dir),
}
RENAMED = {"hf_config_dir": "hf_config", "max_shard_bytes": "max_shard_size_gb", "dtype": "precision"}
"""Converter keyword -> CLI dest where the flag's name or unit differs."""


def _tool_parser(name: str) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _flags(parser: argparse.ArgumentParser) -> dict:
    """Every argument but --help: {dest: (option strings, default, type, choices, nargs, action)}."""
    return {a.dest: (tuple(a.option_strings), a.default, a.type, tuple(a.choices or ()), a.nargs, type(a).__name__)
            for a in parser._actions if not isinstance(a, argparse._HelpAction)}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_megarl_convert_has_the_tools_flags(direction):
    tool, function = DIRECTIONS[direction]
    cli = _subparser(_subparser(build_parser(), "convert"), direction)
    assert _flags(cli) == _flags(_tool_parser(tool))
    # every keyword of the converter is reachable from the command line
    keywords = [p for p in inspect.signature(function).parameters][2:]  # after the two directories
    deprecated = {a.dest for a in cli._actions if (a.help or "").startswith("deprecated")}  # old spellings
    assert sorted(RENAMED.get(k, k) for k in keywords) == sorted(
        dest for dest, flag in _flags(cli).items() if flag[0] and dest not in deprecated)


def test_same_argv_parses_the_same():
    argv = ["hf", "out", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4",
            "--virtual-pipeline-model-parallel-size", "2", "--precision", "bf16", "--overwrite", "--timeout-s", "60"]
    cli = vars(build_parser().parse_args(["convert", "hf-to-megatron", *argv]))
    tool = vars(_tool_parser("convert_hf_to_megatron").parse_args(argv))
    assert {k: v for k, v in cli.items() if k not in ("command", "direction", "debug")} == tool


def test_export_ranks_below_one_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["convert", "megatron-to-hf", "ckpt", "out", "--ranks", "0"])
    assert exit_info.value.code == 2 and "argument --ranks: 0: at least 1" in capsys.readouterr().err
    assert build_parser().parse_args(["convert", "megatron-to-hf", "ckpt", "out", "--ranks", "3"]).ranks == 3
