"""``megarl eval``'s report from a fixed set of trajectories: records (prompt index, tool use,
truncation), the per-mode statistics and pass@k computed by hand, the JSON file and the table."""
import io
import json

import pytest
import torch

from megarl.launch.eval_report import build_report, print_report, summarize, write_report
from megarl.launch.rollout_actor import _records
from megarl.rollout.types import RolloutStatus, Trajectory

ROWS = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}, {"question": "1+1", "answer": "2"}]


def traj(row, group_id, reward, *, status=RolloutStatus.COMPLETED, calls=1, errors=0, tokens=10, reasons=("stop",)):
    ids = torch.arange(tokens)
    return Trajectory(prompt_ids=torch.arange(3), response_ids=ids, loss_mask=torch.ones(tokens, dtype=torch.long),
                      rollout_logprobs=torch.zeros(tokens), reward=reward, status=status, num_turns=2,
                      group_id=group_id, sample=dict(row),
                      metadata={"tool_calls": calls, "tool_errors": errors, "finish_reasons": list(reasons)})


def sampled_trajectories():
    """n = 4 per prompt; prompt 0: 2 correct, one truncated; prompt 1: 0 correct, a tool error;
    prompt 2 (a duplicate of prompt 0's row): its group failed, no trajectories."""
    return [traj(ROWS[0], 7, 1.0, tokens=12), traj(ROWS[0], 7, 0.0, tokens=20, reasons=("stop", "length")),
            traj(ROWS[0], 7, 1.0, tokens=8), traj(ROWS[0], 7, 0.0, status=RolloutStatus.TRUNCATED, calls=2),
            traj(ROWS[1], 8, 0.0, errors=1), traj(ROWS[1], 8, 0.5), traj(ROWS[1], 8, 0.0), traj(ROWS[1], 8, 0.0)]


def test_records_find_each_trajectorys_prompt():
    records = _records(sampled_trajectories(), ROWS)
    assert [r["prompt"] for r in records] == [0] * 4 + [1] * 4
    assert [r["truncated"] for r in records[:4]] == [0, 1, 0, 1]  # a turn cut at its limit; a truncated status
    assert records[3]["tool_calls"] == 2 and records[4]["tool_errors"] == 1 and records[0]["response_tokens"] == 12
    # equal rows take their indices in turn: a second group of the same row is prompt 2
    again = _records([traj(ROWS[0], 1, 1.0), traj(ROWS[0], 2, 0.0)], ROWS)
    assert [r["prompt"] for r in again] == [0, 2]


def test_summary_and_pass_at_k_by_hand():
    s = summarize(_records(sampled_trajectories(), ROWS), num_prompts=3, per_prompt=4, ks=(1, 2, 4))
    assert s["num_trajectories"] == 12 and s["num_failed"] == 4  # prompt 2's four are missing
    assert s["accuracy"] == pytest.approx(2 / 12) and s["reward_mean"] == pytest.approx(2.5 / 12)
    assert s["tool_calls_mean"] == pytest.approx(9 / 8) and s["tool_errors_mean"] == pytest.approx(1 / 8)
    assert s["response_tokens_mean"] == pytest.approx((12 + 20 + 8 + 10 * 5) / 8)
    assert s["truncation_rate"] == pytest.approx(2 / 8)
    # prompt 0: n=4, c=2 -> pass@1 0.5, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 1; prompts 1, 2: 0
    assert s["pass@k"]["1"] == pytest.approx(0.5 / 3)
    assert s["pass@k"]["2"] == pytest.approx((5 / 6) / 3)
    assert s["pass@k"]["4"] == pytest.approx(1 / 3)


def test_report_json_and_table(tmp_path):
    records = {"greedy": _records([traj(ROWS[0], 0, 1.0), traj(ROWS[1], 1, 0.0)], ROWS),
               "sampled": _records(sampled_trajectories(), ROWS)}
    report = build_report(records, num_prompts=3, samples_per_prompt=4, ks=(1, 2, 4),
                          run_metrics={"eval/accuracy": 1 / 3}, source={"model": "ckpt/step_000002"})
    assert report["greedy"]["accuracy"] == pytest.approx(1 / 3) and report["greedy"]["num_failed"] == 1
    path = write_report(report, tmp_path / "out" / "report.json")
    saved = json.loads(path.read_text())
    assert saved["sampled"]["pass@k"]["4"] == pytest.approx(1 / 3) and len(saved["trajectories"]["sampled"]) == 8
    empty = build_report({"greedy": []}, num_prompts=0, samples_per_prompt=0, ks=(), run_metrics={}, source={})
    assert json.loads(write_report(empty, tmp_path / "empty.json").read_text())["greedy"]["accuracy"] is None
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120)
    print_report(report, console)
    text = console.file.getvalue()
    for needle in ("greedy", "sampled (n=4)", "pass@2", "0.278", "truncated", "0.250", "tool errors / traj."):
        assert needle in text, text
