"""The learning-demo task (examples/arithmetic_tool/task.py, a plugin file) and its SFT
demonstrations tokenised as rollouts are."""
import json
import random
from pathlib import Path

import pytest

from megarl.data.demonstrations import DemonstrationError, demonstration_to_trajectory, load_demonstrations
from megarl.plugins import import_module

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "arithmetic_tool" / "task.py"
task = import_module(str(TASK_FILE), "plugins")  # the module the recipe's plugins: and import path name
demonstration, demonstrations = task.demonstration, task.demonstrations
make_arithmetic_rows, split_disjoint = task.make_arithmetic_rows, task.split_disjoint

CALC_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_rows_are_correct_and_deterministic():
    rows = make_arithmetic_rows(200, seed=5, min_digits=2, max_digits=4, operators=("+", "-", "*"))
    assert rows == make_arithmetic_rows(200, seed=5, min_digits=2, max_digits=4, operators=("+", "-", "*"))
    for row in rows:
        a, op, b = row["expression"].split()
        assert 2 <= len(a) <= 4 and 2 <= len(b) <= 4
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["question"] == f'What is "{row["expression"]}"?'
    with pytest.raises(ValueError):
        make_arithmetic_rows(1, seed=0, operators=("/",))


def test_split_is_disjoint():
    train, held_out = split_disjoint(make_arithmetic_rows(300, seed=1, min_digits=1, max_digits=1), 50)
    assert len(held_out) == 50
    assert not {r["expression"] for r in train} & {r["expression"] for r in held_out}


def test_demonstrations_mix_tool_and_direct_answers():
    rows = make_arithmetic_rows(400, seed=2)
    demos = demonstrations(rows, tool_fraction=0.25, seed=0)
    with_tool = [d for d in demos if any(m.get("tool_calls") for m in d)]
    assert 0.18 < len(with_tool) / len(demos) < 0.32
    call = with_tool[0][1]["tool_calls"][0]["function"]
    row = rows[demos.index(with_tool[0])]
    assert call["name"] == "calculator" and json.loads(call["arguments"]) == {"expression": row["expression"]}
    assert with_tool[0][-1]["content"] == f"\\boxed{{{row['answer']}}}"


def test_the_recipes_import_path_builds_the_calculator_demonstrations():
    """sft.demonstrations as the recipe names it: the messages written out by hand, the tool choice
    drawn as one seeded uniform per row (random.Random(seed).random() < tool_fraction)."""
    rows = [{"question": 'What is "48 + 73"?', "answer": "121", "expression": "48 + 73"},
            {"question": 'What is "90 - 15"?', "answer": "75", "expression": "90 - 15"}] * 20
    got = load_demonstrations(f"{TASK_FILE}:demonstrations", rows, system_prompt="Be brief.",
                              tool_fraction=0.5, seed=3, limit=40)
    draws = random.Random(3)
    assert len(got) == 40
    for row, messages in zip(rows, got):
        head = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["question"]}]
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": '{"expression": "' + row["expression"] + '"}'}}
        tool = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": row["answer"]}]
        answer = [{"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}]
        assert messages == head + (tool if draws.random() < 0.5 else []) + answer
    assert 0 < sum(len(m) == 5 for m in got) < 40  # both kinds drawn


def test_sft_trajectory_matches_the_rendered_conversation(tiny_dense_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_dir)
    row = make_arithmetic_rows(1, seed=0)[0]
    messages = demonstration(row, use_tool=True, system_prompt="Use the calculator.")
    traj = demonstration_to_trajectory(tok, messages, tools=[CALC_SCHEMA])
    # Reference 1: the whole conversation rendered at once by the (append-only) tiny template; the
    # trajectory ends, as a rollout does, at the final end-of-turn token (the template adds "\n").
    full = tok.apply_chat_template(messages, tools=[CALC_SCHEMA], tokenize=False)
    assert tok.decode(traj.prompt_ids.tolist() + traj.response_ids.tolist()) + "\n" == full
    assert tok.decode(traj.prompt_ids.tolist()).endswith("<|im_start|>assistant\n")
    # Reference 2: the trained tokens are exactly the two assistant turns, each ending at <|im_end|>.
    ids, mask = traj.response_ids.tolist(), traj.loss_mask.tolist()
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    spans += [tok.decode(cur)] if cur else []
    assert spans == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + row["expression"]
        + '"}}\n</tool_call><|im_end|>', f"\\boxed{{{row['answer']}}}<|im_end|>"]
    assert traj.rollout_logprobs.abs().sum() == 0 and traj.num_turns == 2


def test_demonstration_without_assistant_is_rejected(tiny_dense_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_dir)
    with pytest.raises(DemonstrationError):
        demonstration_to_trajectory(tok, [{"role": "user", "content": "hi"}])
