"""``megarl eval``'s command line: every argument error is one line on stderr and exit status 2
(megarl's UserError convention, tests/unit/test_cli_errors.py), before anything starts; overrides
may follow the options."""
import json
from pathlib import Path

import pytest

from megarl import cli
from megarl.launch import evaluate

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "examples" / "arithmetic_tool" / "arithmetic_tool.yaml")


@pytest.fixture
def dirs(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    step = tmp_path / "run" / "checkpoints" / "step_000004" / "trainer"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (step / ".metadata").write_text("")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000004")
    return {"hf": hf, "empty": empty, "step": step.parent, "save_dir": step.parent.parent}


def one_line_error(capsys, *argv):
    assert cli.main(["eval", RECIPE, *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megarl eval: "), lines
    return lines[0]


def test_argument_errors_are_one_line(capsys, dirs, tmp_path):
    assert "exactly one model" in one_line_error(capsys)
    assert "exactly one model" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--checkpoint", str(dirs["step"]))
    assert "not a Megatron dist checkpoint" in one_line_error(capsys, "--checkpoint", str(dirs["empty"]))
    assert "no config.json" in one_line_error(capsys, "--hf", str(dirs["empty"]))
    assert "argument --samples 0" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--samples", "0")
    assert "positive integers" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--k", "1,x")
    assert "positive integers" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--k", "0")
    assert "pass@8 needs at least 8" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--samples", "4", "--k", "1,8")
    assert "no such file" in one_line_error(capsys, "--hf", str(dirs["hf"]), "--data", str(tmp_path / "nope.jsonl"))
    assert "unrecognized option --bogus" in one_line_error(capsys, "--hf", str(dirs["hf"]), "a=1", "--bogus")


def test_no_evaluation_data_is_one_line(capsys, tiny_moe_dir):
    line = one_line_error(capsys, "--hf", str(tiny_moe_dir), "data.eval_path=null")
    assert "set data.eval_path" in line and "--data" in line


def test_checkpoint_forms_and_default_report_paths(dirs, tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["eval", RECIPE, "--checkpoint", str(dirs["save_dir"])])  # a save_dir: its latest
    request = evaluate.check_args(args)
    assert request.checkpoint == (dirs["step"] / "trainer").resolve()
    assert request.out == (tmp_path / "run" / "eval" / "step_000004.json").resolve()
    assert request.work_dir == request.out.with_suffix("")
    args = parser.parse_args(["eval", RECIPE, "--hf", str(dirs["hf"]), "--out", str(tmp_path / "r.json")])
    assert evaluate.check_args(args).out == (tmp_path / "r.json").resolve()
    assert evaluate.default_ks(4) == (1, 2, 4) and evaluate.default_ks(6) == (1, 2, 4, 6) and evaluate.default_ks(1) == (1,)


def test_overrides_after_options_and_what_eval_sets(monkeypatch, dirs):
    seen = {}
    monkeypatch.setattr(evaluate, "run_eval", lambda args: seen.setdefault("args", args) and 0)
    cli.main(["eval", RECIPE, "a.b=1", "--hf", str(dirs["hf"]), "--samples", "3", "c.d=2"])
    args = seen["args"]
    assert args.overrides == ["a.b=1", "c.d=2"]
    request = evaluate.check_args(args)
    assert evaluate.eval_overrides(request, args, dirs["hf"]) == [
        "a.b=1", "c.d=2", f"model.hf_path={dirs['hf']}", "model.load_dir=null", "data.eval_samples_per_prompt=3"]


def test_a_request_without_a_model_is_an_argument_error(tmp_path):
    """check_args never makes one; built by hand, it fails naming the arguments (before: a
    TypeError / AttributeError from Path(None))."""
    request = evaluate.EvalRequest(None, None, tmp_path / "r.json", None, None)
    with pytest.raises(evaluate.EvalArgumentError, match="exactly one model"):
        request.checkpoint_dir()
    with pytest.raises(evaluate.EvalArgumentError, match="exactly one model"):
        evaluate.export_model(request)
    with pytest.raises(evaluate.EvalArgumentError, match="exactly one model"):
        evaluate._default_out(None, None)
    ckpt = tmp_path / "ckpt"
    assert evaluate.EvalRequest(ckpt, None, tmp_path / "r.json", None, None).checkpoint_dir() == ckpt
