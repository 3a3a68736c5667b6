"""`megarl eval --checkpoint` reproduces the training run's own held-out evaluation (issue 29 §1).

A short real run of examples/arithmetic_tool (tiny Qwen3-MoE, the demo's SFT cold start, then 2
GSPO steps, everything real: Megatron ranks, SGLang, the calculator tool, weight sync) evaluates its
held-out set (16 prompts: greedy + 4 sampled trajectories each, deterministic sampling) after every
step and checkpoints after every step (a GSPO step whose groups all have equal rewards trains
nothing; its checkpoint then repeats the weights). Then `megarl eval` serves each checkpoint
(exported to HF by megarl's converter; a fresh engine, no weight sync involved) and must log the
same ``eval/*`` numbers as the run did at that step and decode the same first greedy trajectory:
the same weights, rows and sampling seeds give the same trajectories. The report's own statistics
are checked against its trajectory records and the run's metrics.

``slow`` (not ``ci``): ~10-15 min on the shared 2-core machine.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "arithmetic_tool" / "arithmetic_tool.yaml"
EVAL_KEYS = ("eval/accuracy", "eval/reward_mean", "eval/tool_calls_mean", "eval/num_samples",
             "eval/sampled_reward_mean", "eval/sampled_accuracy")
OVERRIDES = ["train.num_steps=2", "sft.num_steps=250", "rollout.num_prompts_per_step=8", "rollout.group_size=4",
             "train.global_batch_size=32", "data.eval_interval=1", "data.eval_samples_per_prompt=4",
             "checkpoint.save_interval=1", "checkpoint.keep_last=0", "logging.progress_bar=false",
             "logging.plots=false"]


def _megarl(*args: str, log: Path, timeout_s: float) -> None:
    cmd = [str(Path(sys.executable).parent / "megarl"), *args]
    with open(log, "wb") as out:
        code = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    assert code == 0, log.read_text(errors="replace")[-5000:]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    sys.path.insert(0, str(CONFIG.parent))
    from make_model import make_model

    root = tmp_path_factory.mktemp("eval_demo")
    model = make_model(root / "model").resolve()
    rows = (CONFIG.parent / "data" / "test.jsonl").read_text().splitlines()[:16]
    (root / "eval.jsonl").write_text("\n".join(rows) + "\n")
    run_dir = root / "run"
    _megarl("train", str(CONFIG), f"model.hf_path={model}", f"data.eval_path={root / 'eval.jsonl'}",
            f"logging.run_dir={run_dir}", *OVERRIDES, log=root / "train.console.log", timeout_s=900)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return root, run_dir, {int(m["step"]): m for m in metrics if "eval/accuracy" in m}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("step", [1, 2])
def test_megarl_eval_of_a_checkpoint_reproduces_the_runs_eval(trained_run, step):
    root, run_dir, evals = trained_run
    assert sorted(evals) == [0, 1, 2], sorted(evals)
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    out = root / f"eval_step{step}.json"
    _megarl("eval", str(CONFIG), f"data.eval_path={root / 'eval.jsonl'}", "--checkpoint", str(ckpt),
            "--k", "1,2,4", "--out", str(out), log=root / f"eval{step}.console.log", timeout_s=600)
    report = json.loads(out.read_text())
    logged = evals[step]
    got = {k: report["eval_metrics"][k] for k in EVAL_KEYS}
    assert got == {k: logged[k] for k in EVAL_KEYS}, (got, {k: logged[k] for k in EVAL_KEYS})
    assert logged["eval/tool_calls_mean"] > 0.5, "the SFT cold start taught the tool call: a non-trivial check"
    # The report's statistics agree with the run's metrics and with its own records.
    greedy, sampled = report["greedy"], report["sampled"]
    assert greedy["accuracy"] == pytest.approx(logged["eval/accuracy"])
    assert sampled["accuracy"] == pytest.approx(logged["eval/sampled_accuracy"])
    assert sampled["reward_mean"] == pytest.approx(logged["eval/sampled_reward_mean"])
    assert sampled["pass@k"]["1"] == pytest.approx(sampled["accuracy"])  # pass@1 = mean accuracy
    assert sampled["pass@k"]["1"] <= sampled["pass@k"]["2"] <= sampled["pass@k"]["4"]
    records = report["trajectories"]["sampled"]
    assert len(records) == 16 * 4 and sorted({r["prompt"] for r in records}) == list(range(16))
    solved = {r["prompt"] for r in records if r["reward"] >= 1.0 - 1e-6}
    assert sampled["pass@k"]["4"] == pytest.approx(len(solved) / 16)  # n = k: pass@n = any of n correct
    assert report["source"]["policy_version"] == logged["policy_version"]
    console = (root / f"eval{step}.console.log").read_text()
    assert "pass@4" in console and "megarl eval" in console
    # Token for token: the first greedy trajectory, decoded, as the run logged it at this step
    # (evaluations at steps 0, 1, 2, in order).
    run_samples = re.findall(r"INFO megarl.train: eval sample: (.*)", (run_dir / "train.log").read_text())
    assert len(run_samples) == 3, run_samples
    assert re.findall(r"INFO megarl.eval: eval sample: (.*)", console) == [run_samples[step]]
