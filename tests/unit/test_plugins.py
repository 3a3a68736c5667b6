"""Plugins: user modules named in YAML register tools, rewards, agent loops, datasets and SFT
demonstration builders; import paths
name them directly; `megarl validate` imports and checks them, naming the YAML key of each problem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.plugins import PluginError, absolute_specs, import_plugins, resolve

REPO = Path(__file__).resolve().parents[2]

TASK = '''
import asyncio
from megarl.data.datasets import register_dataset
from megarl.data.demonstrations import register_demonstrations
from megarl.rollout.agent import register_agent, single_turn
from megarl.rollout.rewards.reward_registry import register_reward
from megarl.rollout.tools import register_tool


@register_tool("{prefix}_echo")
class Echo:
    name = "echo"

    def __init__(self, *, upper: bool = False):
        self.upper = upper
        self.schema = {{"type": "function", "function": {{"name": "echo", "description": "echo",
                       "parameters": {{"type": "object", "properties": {{"text": {{"type": "string"}}}}}}}}}}

    async def __call__(self, arguments):
        return arguments["text"].upper() if self.upper else arguments["text"]


class SyncTool:
    name = "sync"
    schema = {{}}

    def __call__(self, arguments):
        return "not a coroutine"


@register_reward("{prefix}_length")
class Length:
    def __init__(self, *, scale: float = 1.0):
        self.scale = scale

    def __call__(self, trajectory, sample):
        return self.scale * len(sample["question"])


def exact(trajectory, sample, *, bonus=0.0):
    return 1.0 + bonus


@register_agent("{prefix}_once")
async def once(ctx, state):
    await single_turn(ctx, state)


@register_dataset("{prefix}_numbers")
def numbers(path, *, count=3):
    return [{{"question": f"{{path}} {{i}}", "answer": str(i)}} for i in range(count)]


@register_demonstrations("{prefix}_demos")
def demos(rows, *, system_prompt, tool_fraction, seed):
    return [[{{"role": "user", "content": r["question"]}}, {{"role": "assistant", "content": f"{{seed}}"}}]
            for r in rows]


def demos_without_seed(rows, *, system_prompt, tool_fraction):
    return []
'''


def write_task(tmp_path: Path, prefix: str) -> Path:
    path = tmp_path / "my_task.py"
    path.write_text(TASK.format(prefix=prefix))
    return path


@pytest.fixture()
def base_overrides(tiny_moe_dir):
    data = REPO / "data" / "gsm8k"
    return [f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}", "data.eval_path=null",
            "cluster.device=cpu", "train.precision=fp32", "train.global_batch_size=16",
            "rollout.num_prompts_per_step=4", "rollout.group_size=4"]


def validate(monkeypatch, capsys, overrides):
    monkeypatch.chdir(REPO)
    code = cli_main(["validate", "configs/base.yaml", *overrides])
    return code, capsys.readouterr()


async def test_a_plugin_file_registers_names_used_by_the_builders(tmp_path):
    from megarl.data.datasets import load_rows
    from megarl.rollout.agent import get_agent_loop
    from megarl.rollout.rewards.reward_registry import build_reward
    from megarl.rollout.tools import build_tools

    task = write_task(tmp_path, "reg")
    (module,) = import_plugins([str(task)])
    assert import_plugins([str(task)]) == [module]  # idempotent: every worker may import it again
    tools = build_tools({"reg_echo": {"upper": True}})
    assert await tools["echo"]({"text": "hi"}) == "HI"
    assert build_reward("reg_length", scale=2.0)(None, {"question": "abc"}) == 6.0
    assert get_agent_loop("reg_once") is module.once
    assert load_rows("reg_numbers", "p", count=2) == [{"question": "p 0", "answer": "0"},
                                                      {"question": "p 1", "answer": "1"}]
    # Import paths name objects without registering them; a reward function gets reward_kwargs.
    assert build_reward(f"{task}:exact", bonus=0.5)(None, {}) == 1.5
    assert await build_tools({f"{task}:Echo": {}})["echo"]({"text": "x"}) == "x"


def test_sft_demonstrations_by_registered_name_and_import_path(tmp_path, monkeypatch):
    from megarl.data.demonstrations import load_demonstrations

    task = write_task(tmp_path, "sft")
    import_plugins([str(task)])
    dotted = TASK[TASK.index("def demos("):TASK.index("def demos_without_seed")].replace("{{", "{").replace("}}", "}")
    (tmp_path / "sft_dotted.py").write_text(dotted)  # the same builder in a module on sys.path
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"question": "q0"}, {"question": "q1"}, {"question": "q2"}]
    expected = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "7"}] for i in range(2)]
    for source in ("sft_demos", f"{task}:demos", "sft_dotted:demos"):
        got = load_demonstrations(source, rows, system_prompt=None, tool_fraction=1.0, seed=7, limit=2)
        assert got == expected, source
    with pytest.raises(PluginError, match="sft.demonstrations: module 'sft_dotted' has no attribute 'demo'"):
        load_demonstrations("sft_dotted:demo", rows, system_prompt=None, tool_fraction=1.0, seed=7, limit=2)
    with pytest.raises(PluginError, match="sft.demonstrations: unknown demonstration builder 'sft_demo'.*sft_demos"):
        load_demonstrations("sft_demo", rows, system_prompt=None, tool_fraction=1.0, seed=7, limit=2)
    with pytest.raises(ValueError, match="sft.demonstrations: file not found"):
        load_demonstrations(str(tmp_path / "none.jsonl"), rows, system_prompt=None, tool_fraction=1.0, seed=7, limit=2)


def test_validate_accepts_plugins_and_import_paths(tmp_path, monkeypatch, capsys, base_overrides):
    task = write_task(tmp_path, "ok")
    code, out = validate(monkeypatch, capsys, [*base_overrides, f"plugins=[{task}]", "rollout.tools={ok_echo: {upper: true}}",
                                               f"rollout.reward={task}:exact", "rollout.reward_kwargs={bonus: 1.0}",
                                               "rollout.agent.name=ok_once", "data.dataset=ok_numbers",
                                               "data.train_path=anything", f"sft.demonstrations={task}:demos"])
    assert code == 0, out.err
    assert out.out.startswith("OK configs/base.yaml")


def test_validate_names_the_key_of_each_bad_name(tmp_path, monkeypatch, capsys, base_overrides):
    task = write_task(tmp_path, "bad")
    code, out = validate(monkeypatch, capsys, [
        *base_overrides, f"plugins=[{task}]",
        "rollout.tools={bad_ecoh: {}}",                              # misspelled registry name
        f"rollout.reward={task}:exat",                               # misspelled attribute
        "rollout.agent.name=my_pkg.agnets:loop",                     # misspelled module
        "data.dataset=bad_numbers", "data.dataset_kwargs={cuont: 2}",  # kwargs the reader does not take
        f"sft.demonstrations={task}:demso"])                          # misspelled builder attribute
    assert code == 2
    lines = out.err.splitlines()
    assert any(ln.startswith("  - rollout.tools.bad_ecoh=") and "unknown tool 'bad_ecoh'" in ln
               and "bad_echo" in ln for ln in lines), out.err
    assert any(ln.startswith("  - rollout.reward=") and "has no attribute 'exat'" in ln for ln in lines), out.err
    assert any(ln.startswith("  - rollout.agent.name=") and "no module named 'my_pkg'" in ln for ln in lines), out.err
    assert any(ln.startswith("  - data.dataset=") and "cuont" in ln for ln in lines), out.err
    assert any(ln.startswith("  - sft.demonstrations=") and "has no attribute 'demso'" in ln for ln in lines), out.err
    for bad, message in (("examples/arithmetic_tool/tsak.py:demonstrations", "plugin file not found"),
                         ("my_tasks.arith:demonstrations", "no module named 'my_tasks'"),
                         ("gsm8k_pyton", "unknown demonstration builder 'gsm8k_pyton'")):
        code, out = validate(monkeypatch, capsys, [*base_overrides, f"sft.demonstrations={bad}"])
        assert code == 2 and "invalid configuration (1 problem): sft.demonstrations=" in out.err and message in out.err, out.err


def test_validate_rejects_wrong_protocols(tmp_path, monkeypatch, capsys, base_overrides):
    task = write_task(tmp_path, "proto")
    code, out = validate(monkeypatch, capsys, [
        *base_overrides, f"rollout.tools={{'{task}:SyncTool': {{}}}}",  # __call__ is not async
        f"rollout.reward={task}:Echo",                                   # a class without reward kwargs...
        "rollout.reward_kwargs={scale: 2}",
        f"rollout.agent.name={task}:exact",                              # not a coroutine function
        f"sft.demonstrations={task}:demos_without_seed"])                # no seed parameter
    assert code == 2
    assert "SyncTool is not a Tool: it needs `async def __call__" in out.err
    assert "rollout.reward_kwargs do not fit Echo" in out.err
    assert "rollout.agent.name=" in out.err and "is not an agent loop" in out.err
    assert "sft.demonstrations=" in out.err and "builder(rows, *, system_prompt, tool_fraction, seed)" in out.err


def test_a_plugin_that_fails_to_import_is_reported_with_its_index(tmp_path, monkeypatch, capsys, base_overrides):
    broken = tmp_path / "broken.py"
    broken.write_text("import json\nraise RuntimeError('no API key')\n")
    code, out = validate(monkeypatch, capsys, [*base_overrides, f"plugins=[json, {broken}]"])
    assert code == 2
    assert "plugins[1]=" in out.err and "RuntimeError: no API key" in out.err
    with pytest.raises(PluginError, match=r"plugins\[0\]: no module named 'no_such_pkg'"):
        import_plugins(["no_such_pkg.tasks"])


def test_relative_plugin_files_become_absolute(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("examples/arithmetic_tool/arithmetic_tool.yaml",
                      ["algorithm.policy_loss=examples/losses.py:my_loss", "algorithm.advantage_estimator=my.mod:est",
                       "weight_sync.transport=examples/sync.py:MyTransport"])
    absolute_specs(cfg)
    assert cfg.plugins == [str(REPO / "examples/arithmetic_tool/task.py")]
    assert cfg.algorithm.policy_loss == f"{REPO / 'examples/losses.py'}:my_loss"  # a file part, made absolute
    assert cfg.algorithm.advantage_estimator == "my.mod:est" and cfg.algorithm.rollout_correction == "none"
    assert cfg.weight_sync.transport == f"{REPO / 'examples/sync.py'}:MyTransport"
    assert cfg.rollout.reward == "arithmetic_answer"  # registry names are left alone
    assert cfg.sft.demonstrations == f"{REPO / 'examples/arithmetic_tool/task.py'}:demonstrations"
    with pytest.raises(PluginError, match="rollout.reward: unknown reward 'nope'"):
        resolve("nope", {}, key="rollout.reward", kind="reward")


@pytest.mark.timeout(120)
async def test_the_arithmetic_example_loads_its_tool_and_reward_through_plugins(tokenizer_dir, monkeypatch):
    """The example's own tool and reward (examples/arithmetic_tool/task.py) run in the agent loop."""
    import sys

    from transformers import AutoTokenizer

    from megarl.rollout.manager import RolloutManager

    sys.path.insert(0, str(REPO / "tests" / "unit" / "rollout"))
    from rollout_scripted import Reply, ScriptedEngine

    monkeypatch.chdir(REPO)
    cfg = load_config("examples/arithmetic_tool/arithmetic_tool.yaml", [])
    absolute_specs(cfg)
    import_plugins(cfg.plugins)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "48 + 73"}}) + "\n</tool_call>"
    engine = ScriptedEngine(tokenizer, lambda ids, turn: Reply(call) if turn == 0 else Reply("\\boxed{121}"))
    cfg.rollout.group_size = 2
    cfg.rollout.num_prompts_per_step = 1
    cfg.rollout.agent.max_context_tokens = 2048  # the example's model has a compact template; this one lists schemas
    manager = RolloutManager(engine, tokenizer, cfg.rollout, filter_zero_variance=False)
    try:
        batch = await manager.generate_groups(iter([{"question": "What is (48 + 73)?", "answer": "121"}]))
    finally:
        await manager.close()
    (group,) = batch.groups
    for traj in group.trajectories:
        assert traj.reward == 1.0 and traj.metadata["tool_calls"] == 1 and traj.metadata["tool_errors"] == 0
        observation = tokenizer.decode(traj.response_ids[traj.loss_mask == 0].tolist())
        assert "121" in observation


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_moe_dir):
    return tiny_moe_dir
