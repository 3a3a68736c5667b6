"""run_dir/rollouts/step_N.jsonl: one JSON line per trajectory, decoded with the run's tokenizer."""
import json

import torch

from megarl.launch.mfu import mean_seq_len
from megarl.launch.rollout_log import write_rollouts
from megarl.rollout.rewards.composite import TERMS_KEY
from megarl.rollout.types import Trajectory, TrajectoryGroup


def test_rollouts_file_round_trips(tmp_path, official_template_tokenizers):
    tok = official_template_tokenizers["qwen3"]
    prompt, response = tok.encode("What is 2+3?"), tok.encode("<tool_call>print(2+3)</tool_call> 5")
    traj = Trajectory(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
                      loss_mask=torch.ones(len(response), dtype=torch.long),
                      rollout_logprobs=torch.zeros(len(response)), reward=1.0, num_turns=2, policy_version=3,
                      group_id=7, sample={"prompt": "What is 2+3?"},
                      metadata={"tool_calls": 1, TERMS_KEY: {"correct": 1.0, "format": 0.5}})
    path = write_rollouts(tmp_path, 4, [TrajectoryGroup(group_id=7, trajectories=[traj, traj])], tok)
    assert path == tmp_path / "rollouts" / "step_4.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    row = rows[0]
    assert row["prompt"] == tok.decode(prompt) and row["response"] == tok.decode(response)
    assert "print(2+3)" in row["response"]
    assert (row["prompt_tokens"], row["response_tokens"], row["trained_tokens"]) == (
        len(prompt), len(response), len(response))
    assert (row["group_id"], row["policy_version"], row["reward"], row["tool_calls"]) == (7, 3, 1.0, 1)
    assert row["reward_terms"] == {"correct": 1.0, "format": 0.5}
    assert row["question"] == "What is 2+3?"
    assert mean_seq_len([TrajectoryGroup(group_id=7, trajectories=[traj])]) == len(prompt) + len(response)


def test_progress_bar_only_on_a_terminal(monkeypatch):
    import io

    from megarl.launch.step_log import StepLog

    def bar():
        return StepLog(None, None, None, num_steps=3, first_step=0, progress_bar=True).progress

    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    assert bar().disable
    monkeypatch.setattr(pipe, "isatty", lambda: True, raising=False)
    assert not bar().disable
