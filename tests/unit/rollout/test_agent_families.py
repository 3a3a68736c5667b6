"""The agent loop with official chat templates (Qwen3 thinking on / off, DeepSeek-R1, DeepSeek-V3.1, GLM-4.5).

Per template a scripted trajectory (reasoning, tool call, observation, twice, then an answer) runs
through the real loop with the family's SGLang reasoning parser and tool-call detector (``auto``):
every engine input is a prefix of the final sequence, ``loss_mask`` is 1 exactly on generated
tokens, a call drafted inside the reasoning is not run, and a ``<tool_call>`` mentioned in the
reasoning does not swallow the real call. The rewards see the answer only.
"""
import json
from types import SimpleNamespace

import pytest
from rollout_scripted import Reply, ScriptedEngine
from turn_checks import assert_engine_inputs_are_prefixes, record_outputs

from megarl.rollout.agent import AgentContext, new_state, run_agent, single_turn, tool_agent
from megarl.rollout.rewards.gsm8k_answer import Gsm8kReward
from megarl.rollout.template import build_template
from megarl.rollout.tools import build_tools
from megarl.rollout.types import RolloutStatus

QUESTION = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many?"}]


def qwen_call(expression):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


def deepseek_call(expression):
    return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
            + json.dumps({"expression": expression}) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def v31_call(expression):
    return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>"
            + json.dumps({"expression": expression}) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def glm_call(expression):
    return f"<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{expression}</arg_value>\n</tool_call>"


# Each turn: a draft call (999 * 2 = 1998) or a <tool_call> mention inside the reasoning, then the real call.
SCRIPTS = {
    "qwen3-thinking": [
        Reply("<think>\nMay is half of April. I could call <tool_call> now; a draft:\n" + qwen_call("999 * 2")
              + "\nNo, May first.\n</think>\n\n" + qwen_call("48 / 2")),
        Reply("<think>\nNow the sum, in a <tool_call>\nblock.\n</think>\n\n" + qwen_call("48 + 24")),
        Reply("<think>\nSo \\boxed{72}.\n</think>\n\nThe answer is \\boxed{72}.")],
    "qwen3-no-thinking": [  # the empty think block is in every generation prompt; the model writes none
        Reply(qwen_call("48 / 2")), Reply(qwen_call("48 + 24")), Reply("The answer is \\boxed{72}.")],
    "deepseek_r1": [  # the generation prompt ends in "<think>\n": the first turn starts inside reasoning
        Reply("May is half of April. A draft: " + deepseek_call("999 * 2") + " No, May first.\n</think>\n\n"
              + deepseek_call("48 / 2")),
        Reply("<think>\nNow the sum; " + deepseek_call("999 * 2") + "\n</think>\n\n" + deepseek_call("48 + 24")),
        Reply("<think>\nSo \\boxed{72}.\n</think>\n\nThe answer is \\boxed{72}.")],
    "deepseek_v31-thinking": [  # thinking: the generation prompt ends in "<think>"
        Reply("May is half of April. A draft: " + v31_call("999 * 2") + " No, May first.</think>" + v31_call("48 / 2")),
        Reply("<think>Now the sum; " + v31_call("999 * 2") + "</think>" + v31_call("48 + 24")),
        Reply("<think>So \\boxed{72}.</think>The answer is \\boxed{72}.")],
    "deepseek_v31-no-thinking": [  # the default: the generation prompt closes the reasoning ("</think>")
        Reply(v31_call("48 / 2")), Reply(v31_call("48 + 24")), Reply("The answer is \\boxed{72}.")],
    "glm4_moe": [  # GLM-4.5 stops on <|observation|> / <|user|> (generation_config EOS), not on an EOS token
        Reply("<think>May is half of April. I could call <tool_call> now; a draft: " + glm_call("999 * 2")
              + " No.</think>\n" + glm_call("48 / 2") + "<|observation|>", eos=False),
        Reply("<think>Now I will use <tool_call> for the sum.</think>\n" + glm_call("48 + 24") + "<|observation|>",
              eos=False),
        Reply("<think>So \\boxed{72}.</think>\nThe answer is \\boxed{72}.<|user|>", eos=False)],
}
TEMPLATES = {  # case: (tiny family, chat template, chat_template_kwargs, generation prompt, prompt after tools)
    "qwen3-thinking": ("qwen3", "qwen3", {}, "<|im_start|>assistant\n", "<|im_start|>assistant\n"),
    "qwen3-no-thinking": ("qwen3", "qwen3", {"enable_thinking": False},
                          "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "deepseek_r1": ("deepseek_v3", "deepseek_r1", {}, "<｜Assistant｜><think>\n", "<｜tool▁outputs▁end｜>"),
    "deepseek_v31-thinking": ("deepseek_v3", "deepseek_v31", {"thinking": True}, "<｜Assistant｜><think>",
                              "<｜tool▁output▁end｜>"),
    "deepseek_v31-no-thinking": ("deepseek_v3", "deepseek_v31", {}, "<｜Assistant｜></think>", "<｜tool▁output▁end｜>"),
    "glm4_moe": ("glm4_moe", "glm4_moe", {}, "<|assistant|>", "<|assistant|>"),
}


@pytest.fixture(scope="module")
def family_tokenizers(official_template_tokenizers):
    return official_template_tokenizers


def make_ctx(tokenizer, case, turns, reasoning_parser="auto"):
    family, template, kwargs, *_ = TEMPLATES[case]
    tools = build_tools({"calculator": {}})
    agent = SimpleNamespace(system_prompt=None, reasoning_parser=reasoning_parser, tool_call_parser="auto",
                            chat_template_kwargs=kwargs)
    chat, parser = build_template(tokenizer, agent, tools)
    engine = record_outputs(ScriptedEngine(tokenizer, lambda ids, k: turns[k]))
    return AgentContext(engine=engine, template=chat, tools=tools, parser=parser, max_turns=4,
                        sampling_params={"temperature": 1.0, "max_new_tokens": 200})


async def run(ctx, loop=tool_agent):
    state = new_state(ctx, ctx.template.prompt_ids(QUESTION), {}, group_id=0)
    return await run_agent(loop, ctx, state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(TEMPLATES))
async def test_official_template_trajectory(family_tokenizers, case):
    family, template, kwargs, generation_prompt, prompt_after_tools = TEMPLATES[case]
    tokenizer = family_tokenizers[template]
    ctx = make_ctx(tokenizer, case, SCRIPTS[case])
    traj = await run(ctx)
    engine = ctx.engine
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 3, traj.metadata.get("error")
    assert_engine_inputs_are_prefixes(engine, traj)
    # The template's own text before each turn: the generation prompt (with the kwargs), then after
    # each observation the template's continuation (Qwen3 without thinking: the empty think block).
    inputs = [tokenizer.decode(c["input_ids"]) for c in engine.calls]
    assert inputs[0].endswith(generation_prompt)
    assert all(text.endswith(prompt_after_tools) for text in inputs[1:])
    # Only the two real calls ran: the drafts inside the reasoning did not, and the <tool_call>
    # mentions in the reasoning did not swallow the real calls.
    observations = tokenizer.decode(traj.response_ids[traj.loss_mask == 0].tolist())
    assert traj.metadata["tool_calls"] == 2 and traj.metadata["tool_errors"] == 0
    assert "24" in observations and "72" in observations and "1998" not in observations
    assert traj.metadata["final_text"].strip() == "The answer is \\boxed{72}."
    if not case.endswith("no-thinking"):
        assert traj.metadata["reasoning_text"].strip() == "So \\boxed{72}."
    if case == "glm4_moe":  # the model's stop token is trained once, not appended again
        assert observations.startswith("\n<tool_response>\n24\n</tool_response><|assistant|>")
        assert tokenizer.decode(traj.response_ids[-1:]) == "<|user|>" and traj.loss_mask[-1] == 1


@pytest.mark.timeout(120)
async def test_without_reasoning_separation_drafts_run_and_mentions_swallow_calls(family_tokenizers):
    """Negative control: the same Qwen3 trajectory read without the reasoning parser runs the draft
    and loses the second real call to the <tool_call> mentioned in the reasoning."""
    ctx = make_ctx(family_tokenizers["qwen3"], "qwen3-thinking", SCRIPTS["qwen3-thinking"], reasoning_parser="none")
    traj = await run(ctx)
    observations = family_tokenizers["qwen3"].decode(traj.response_ids[traj.loss_mask == 0].tolist())
    assert "1998" in observations and traj.metadata["tool_errors"] >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["qwen3-thinking", "deepseek_r1", "glm4_moe"])
@pytest.mark.parametrize("final,reward", [
    ("<think>\nIt is \\boxed{72}.\n</think>\n\nI am not sure.", 0.0),       # boxed only while thinking
    ("<think>\nMaybe \\boxed{5}.\n</think>\n\nThe answer is \\boxed{72}.", 1.5),
])
async def test_reward_scores_the_answer_not_the_reasoning(family_tokenizers, case, final, reward):
    tokenizer = family_tokenizers[TEMPLATES[case][1]]
    if case == "deepseek_r1":  # the prompt opened the reasoning: the model writes no <think>
        final = final.removeprefix("<think>\n")
    end = "<|user|>" if case == "glm4_moe" else ""
    ctx = make_ctx(tokenizer, case, [Reply(final + end, eos=not end)])
    traj = await run(ctx, loop=single_turn)
    assert "\\boxed{" in traj.metadata["reasoning_text"]
    score = await Gsm8kReward(executor="inline", format_weight=0.5)(traj, {"answer": "... #### 72"})
    assert score == reward


def test_tiny_models_take_an_official_template(official_template_tokenizers):
    from pathlib import Path

    from megarl.models.tiny import parse_tiny_uri

    assert parse_tiny_uri("tiny:qwen3_moe?chat_template=qwen3").chat_template == "qwen3"
    with pytest.raises(ValueError, match="chat_template"):
        parse_tiny_uri("tiny:qwen3?chat_template=llama3")
    # GLM-4.5's stop tokens are EOS ids of generation_config.json, as in the released model.
    glm = official_template_tokenizers["glm4_moe"]
    stops = json.loads((Path(glm.name_or_path) / "generation_config.json").read_text())["eos_token_id"]
    assert glm.convert_ids_to_tokens(stops) == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    # The templates' special tokens are single tokens (DeepSeek's BOS is written by the template).
    deepseek = official_template_tokenizers["deepseek_r1"]
    ids = deepseek.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = deepseek.encode(ids, add_special_tokens=False)
    assert deepseek.convert_ids_to_tokens(ids[:2]) == ["<｜begin▁of▁sentence｜>", "<｜User｜>"]
    assert deepseek.convert_ids_to_tokens(ids[-3:-1]) == ["<｜Assistant｜>", "<think>"]
