"""Every ``megarl`` subcommand meets bad input with one line on stderr and exit status 2 (issue 38 §1).

A property over a corpus: for each subcommand ``megarl --help`` lists, bad paths (missing, a file
where a directory is expected, a directory where a file is, a place even root may not write),
damaged models (a truncated safetensors shard, a ``config.json`` claiming 6 experts where the
weights hold 8), bad values and unknown options. The CLI's ``main`` runs in this process with stdout
and stderr captured (none of these inputs gets as far as Ray or a rank): any exception escaping it,
any ``Traceback`` on stderr or any status other than 2 fails. The corpus must name every subcommand
the parser has, so a new one cannot be added without its bad inputs.
"""
import argparse
import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from megarl.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
BASE = str(REPO / "configs" / "base.yaml")
GPU = str(REPO / "configs" / "qwen3_30b_a3b_gpu.yaml")
NOT_WRITABLE = "/sys/megarl_out"  # sysfs refuses mkdir even to root (the tests run as root)


def run_cli(argv: list[str]) -> tuple[int | str, str, str]:
    """``megarl.cli.main(argv)`` in this process: (exit status, stdout, stderr); an exception that
    escapes ``main`` is returned as the status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's usage errors
            status = e.code
        except Exception as e:  # noqa: BLE001 - the property under test: none escapes
            status = f"{type(e).__name__}: {e}"
    return status, out.getvalue(), err.getvalue()


def subcommands() -> set[str]:
    """The subcommands ``megarl --help`` lists (``convert`` and ``index`` with their own)."""
    def names(parser):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices

    top = names(build_parser())
    return {f"{name} {inner}" if isinstance(p, argparse.ArgumentParser) and any(
                isinstance(a, argparse._SubParsersAction) for a in p._actions) else name
            for name, p in top.items() for inner in (names(p) if any(
                isinstance(a, argparse._SubParsersAction) for a in p._actions) else [None])}


@pytest.fixture(scope="module")
def bad(tiny_moe_dir, tmp_path_factory):
    """Damaged copies of the tiny MoE model, a fake run and a fake checkpoint folder."""
    root = tmp_path_factory.mktemp("bad_inputs")
    truncated = root / "truncated"
    shutil.copytree(tiny_moe_dir, truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    experts6 = root / "experts6"
    shutil.copytree(tiny_moe_dir, experts6)
    cfg = json.loads((experts6 / "config.json").read_text())
    assert cfg["num_local_experts"] == 8
    cfg["num_local_experts"] = 6  # the weights hold 8
    (experts6 / "config.json").write_text(json.dumps(cfg))
    (root / "a_file").write_text("x\n")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "x").write_text("x\n")
    (root / "broken.yaml").write_text("model: [unclosed\n")
    (root / "run" / "rollouts").mkdir(parents=True)
    (root / "run" / "rollouts" / "step_1.jsonl").write_text("{}\n")
    step = root / "ckpt" / "checkpoints" / "step_2" / "trainer"  # a dist checkpoint's marker files only
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (step / ".metadata").write_bytes(b"")
    (root / "ckpt" / "checkpoints" / "latest").write_text("step_2\n")
    return {"root": root, "model": tiny_moe_dir, "truncated": truncated, "experts6": experts6}


def corpus(b) -> dict[str, list[list[str]]]:
    """Bad command lines per subcommand (every one must end with exit 2 and no traceback)."""
    r = b["root"]
    missing, a_file = str(r / "missing"), str(r / "a_file")
    ckpts = str(r / "ckpt" / "checkpoints")
    config_cases = [
        [missing], [str(r)], [str(r / "broken.yaml")], [BASE, "rollout.no_such_key=1"],
        [BASE, "parallel.tensor_model_parallel_size=abc"], [BASE, f"model.hf_path={missing}"],
        [BASE, f"model.hf_path={b['truncated']}"], [BASE, f"model.hf_path={b['experts6']}"],
        [BASE, "--no-such-option"],
    ]
    return {
        "train": [["train", *c] for c in config_cases],
        "validate": [["validate", *c] for c in config_cases] + [["validate", BASE, "--cpu-scale", "x"]],
        "config": [["config", *c] for c in config_cases[:5]] + [["config", BASE, "--sources=x"]],
        "plan": [["plan", *c] for c in config_cases] + [["plan", GPU, "--gpu", "nope"], ["plan", GPU, "--mfu", "x"]],
        "plan-sync": [["plan-sync", *c] for c in config_cases] + [["plan-sync", BASE, "--intra-gbps", "x"]],
        "eval": [["eval", BASE], ["eval", BASE, "--hf", missing], ["eval", BASE, "--hf", a_file],
                 ["eval", BASE, "--hf", str(b["truncated"])], ["eval", BASE, "--hf", str(b["experts6"])],
                 ["eval", BASE, "--checkpoint", missing], ["eval", BASE, "--checkpoint", ckpts, "--hf", missing],
                 ["eval", BASE, "--hf", str(b["model"]), "--samples", "0"],
                 ["eval", BASE, "--hf", str(b["model"]), "--k", "x"],
                 ["eval", BASE, "--hf", str(b["model"]), "--data", missing],
                 ["eval", missing, "--hf", str(b["model"])]],
        "convert hf-to-megatron": [
            ["convert", "hf-to-megatron", "/nonexistent/hf", str(r / "out1")],
            ["convert", "hf-to-megatron", a_file, str(r / "out1")],
            ["convert", "hf-to-megatron", str(b["truncated"]), str(r / "out1")],
            ["convert", "hf-to-megatron", str(b["experts6"]), str(r / "out1")],
            ["convert", "hf-to-megatron", str(b["model"]), str(r / "nonempty")],
            ["convert", "hf-to-megatron", str(b["model"]), str(Path(a_file) / "out")],
            ["convert", "hf-to-megatron", str(b["model"]), NOT_WRITABLE],
            ["convert", "hf-to-megatron", str(b["model"]), str(r / "out1"), "--tensor-model-parallel-size", "x"]],
        "convert megatron-to-hf": [
            ["convert", "megatron-to-hf", missing, str(r / "out2")],
            ["convert", "megatron-to-hf", str(r), str(r / "out2")],
            ["convert", "megatron-to-hf", ckpts, str(r / "out2")],  # accepted: its latest step has no hf_config
            ["convert", "megatron-to-hf", ckpts, str(r / "out2"), "--hf-config", "/nonexistent"]],
        "index build": [["index", "build", missing, str(r / "idx")], ["index", "build", str(r), str(r / "idx")],
                        ["index", "build", a_file, str(r / "idx"), "--backend", "nope"]],
        "doctor": [["doctor", "--bogus"]],
        "make-tiny-model": [["make-tiny-model", str(r / "tm"), "--family", "nope"],
                            ["make-tiny-model", str(r / "tm"), "--hidden-size", "x"]],
        "show": [["show", missing], ["show", str(r / "run"), "--html", str(r / "missing" / "x.html")],
                 ["show", str(r / "run"), "--step", "9"], ["show", str(r / "run"), "--filter", "nope<"],
                 ["show", str(r / "run"), "--step", "x"]],
    }


def test_corpus_covers_every_subcommand(bad):
    assert subcommands() <= set(corpus(bad)), subcommands() - set(corpus(bad))


# What the line must say for the cases the issue names (the rest: any one line).
def named_messages(b) -> dict[tuple[str, ...], str]:
    r = b["root"]
    ckpts = str(r / "ckpt" / "checkpoints")
    return {
        ("convert", "hf-to-megatron", "/nonexistent/hf", str(r / "out1")): "/nonexistent/hf is not a Hugging Face",
        ("convert", "hf-to-megatron", str(b["model"]), str(r / "nonempty")): "exists and is not empty",
        ("convert", "megatron-to-hf", ckpts, str(r / "out2")): f"{ckpts}/step_2/trainer/hf_config/config.json",
        ("convert", "megatron-to-hf", ckpts, str(r / "out2"), "--hf-config", "/nonexistent"):
            "--hf-config /nonexistent: not /nonexistent/config.json is missing",
        ("show", str(r / "run"), "--html", str(r / "missing" / "x.html")): f"--html {r / 'missing' / 'x.html'}",
        ("validate", BASE, f"model.hf_path={b['truncated']}"): "truncated checkpoint shard",
        ("validate", BASE, f"model.hf_path={b['experts6']}"): "num_experts",
        ("eval", BASE, "--hf", str(b["truncated"])): "truncated checkpoint shard",
        ("eval", BASE, "--hf", str(b["experts6"])): "num_experts",
        ("train", BASE, f"model.hf_path={b['experts6']}"): "num_experts",
        ("convert", "hf-to-megatron", str(b["model"]), NOT_WRITABLE): NOT_WRITABLE,
    }


@pytest.mark.timeout(300)
def test_every_bad_input_is_one_line_and_exit_2(bad, monkeypatch):
    monkeypatch.delenv("MEGARL_DEBUG", raising=False)
    monkeypatch.chdir(REPO)  # the recipes' relative data paths
    needles = named_messages(bad)
    failures = []
    for cases in corpus(bad).values():
        for argv in cases:
            status, out, err = run_cli(argv)
            # one line; an invalid config lists its problems one per line below it (all of them at once)
            lines = [line for line in err.splitlines() if line.startswith("megarl")]
            needle = needles.get(tuple(argv), "")
            ok = (status == 2 and "Traceback" not in err and len(lines) == 1 and needle in err
                  and not out)  # nothing printed before the error (show --html: not the run)
            if not ok:
                failures.append(f"megarl {' '.join(argv)}: exit {status}\n{err[-600:]}{out[-300:]}")
    assert not failures, f"{len(failures)} bad inputs not reported as one line, exit 2:\n" + "\n".join(failures)
