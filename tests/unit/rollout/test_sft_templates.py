"""SFT demonstrations with official chat templates, laid out exactly as the agent loop lays out rollouts.

Reference 1: replaying a demonstration's model turns through the real agent loop (scripted engine,
real calculator) gives the same prompt ids, response ids and loss mask. Reference 2: the trained
spans, written out by hand from each template's documented format.
"""
import json
from types import SimpleNamespace

import pytest
from rollout_scripted import Reply, ScriptedEngine

from megarl.data.demonstrations import DemonstrationError, demonstration_to_trajectory
from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
from megarl.rollout.template import build_template
from megarl.rollout.tools import build_tools

SYSTEM = "Use the calculator."
QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in May?"
CASES = {  # case: (template, chat_template_kwargs)
    "qwen3-thinking": ("qwen3", {}),
    "qwen3-no-thinking": ("qwen3", {"enable_thinking": False}),
    "deepseek_r1": ("deepseek_r1", {}),
    "glm4_moe": ("glm4_moe", {}),
}


def tool_call(expression):
    return {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}


def demonstration(thinking=False):
    first = {"role": "assistant", "content": "", "tool_calls": [tool_call("48 / 2")]}
    final = {"role": "assistant", "content": "The answer is \\boxed{24}."}
    if thinking:
        first["reasoning_content"] = "Half of 48."
        final["reasoning_content"] = "The tool said 24."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}, first,
            {"role": "tool", "content": "24"}, final]


def agent_config(kwargs):
    return SimpleNamespace(system_prompt=SYSTEM, reasoning_parser="auto", tool_call_parser="auto",
                           chat_template_kwargs=kwargs)


def spans(tokenizer, traj):
    """Decoded runs of equal loss_mask: [(mask, text), ...]."""
    out = []
    for token, m in zip(traj.response_ids.tolist(), traj.loss_mask.tolist()):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return [(m, tokenizer.decode(ids)) for m, ids in out]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("case", list(CASES))
async def test_demonstration_equals_the_agent_loop_replaying_it(official_template_tokenizers, case, thinking):
    template_name, kwargs = CASES[case]
    if thinking and kwargs.get("enable_thinking") is False:
        pytest.skip("reasoning with thinking off is refused (test below)")
    tokenizer = official_template_tokenizers[template_name]
    tools = build_tools({"calculator": {}})
    template, parser = build_template(tokenizer, agent_config(kwargs), tools)
    messages = demonstration(thinking)
    sft = demonstration_to_trajectory(tokenizer, messages, template=template)
    model_turns = [text for m, text in spans(tokenizer, sft) if m == 1]
    assert len(model_turns) == 2 and sft.num_turns == 2
    # Replay: the engine emits exactly the demonstration's model turns (their end-of-turn token included).
    engine = ScriptedEngine(tokenizer, lambda ids, k: Reply(model_turns[k], eos=False))
    ctx = AgentContext(engine=engine, template=template, tools=tools, parser=parser,
                       sampling_params={"max_new_tokens": 500})
    state = new_state(ctx, template.prompt_ids([messages[1]]), {}, group_id=0)
    rollout = await run_agent(tool_agent, ctx, state)
    assert rollout.metadata["tool_calls"] == 1 and rollout.metadata["tool_errors"] == 0
    assert rollout.metadata["final_text"].strip() == "The answer is \\boxed{24}."
    assert sft.prompt_ids.tolist() == rollout.prompt_ids.tolist()
    assert sft.response_ids.tolist() == rollout.response_ids.tolist()
    assert sft.loss_mask.tolist() == rollout.loss_mask.tolist()


def test_trained_spans_follow_each_template(official_template_tokenizers):
    """What the model is trained to write, per template, against the templates' own formats."""
    call_qwen = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call>'
    expected = {
        ("qwen3-no-thinking", False): [call_qwen + "<|im_end|>", "The answer is \\boxed{24}.<|im_end|>"],
        ("qwen3-thinking", True): ["<think>\nHalf of 48.\n</think>\n\n" + call_qwen + "<|im_end|>",
                                   "<think>\nThe tool said 24.\n</think>\n\nThe answer is \\boxed{24}.<|im_end|>"],
        # DeepSeek-R1: the prompt opened <think>; the template renders no reasoning after tool output.
        ("deepseek_r1", True): [
            "Half of 48.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
            '```json\n{"expression": "48 / 2"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            "The answer is \\boxed{24}.<｜end▁of▁sentence｜>"],
        # GLM-4.5: an empty think block when there is no reasoning; the turn ends on the stop token.
        ("glm4_moe", False): [
            "\n<think></think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>48 / 2"
            "</arg_value>\n</tool_call><|observation|>", "\n<think></think>\nThe answer is \\boxed{24}.<|user|>"],
    }
    for (case, thinking), turns in expected.items():
        template_name, kwargs = CASES[case]
        tokenizer = official_template_tokenizers[template_name]
        template, _ = build_template(tokenizer, agent_config(kwargs), build_tools({"calculator": {}}))
        traj = demonstration_to_trajectory(tokenizer, demonstration(thinking), template=template)
        assert [text for m, text in spans(tokenizer, traj) if m == 1] == turns, case


@pytest.mark.parametrize("case", ["qwen3-no-thinking", "glm4_moe"])
def test_layouts_the_loop_cannot_produce_are_refused(official_template_tokenizers, case):
    template_name, kwargs = CASES[case]
    tokenizer = official_template_tokenizers[template_name]
    if case == "glm4_moe":
        kwargs = {"enable_thinking": False}
    # Reasoning while the generation prompt already closed the think block.
    with pytest.raises(DemonstrationError, match="message 2"):
        demonstration_to_trajectory(tokenizer, demonstration(thinking=True), chat_template_kwargs=kwargs)
    # A user message after the first model turn: the agent loop never appends one.
    messages = demonstration() + [{"role": "user", "content": "And June?"}]
    with pytest.raises(DemonstrationError, match="message 5: a user message"):
        demonstration_to_trajectory(tokenizer, messages, chat_template_kwargs=kwargs)
