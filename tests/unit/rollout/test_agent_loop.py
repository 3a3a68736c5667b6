"""Agent loop: engine inputs are prefixes of the final sequence, masks, stops, malformed calls.

Official templates (Qwen3, DeepSeek-V3/R1, GLM-4.5) and reasoning: test_agent_families.py."""
import asyncio
import json

import pytest
import torch
from rollout_scripted import Reply
from turn_checks import assert_engine_inputs_are_prefixes, record_outputs

from megarl.rollout.agent import AgentContext, get_agent_loop, new_state, run_agent, single_turn, tool_agent
from megarl.rollout.template import ChatTemplate
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.calls import ToolCallParser
from megarl.rollout.types import RolloutStatus

QUESTION = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many?"}]


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def make_ctx(tokenizer, engine, tool_names=("calculator",), **limits):
    tools = build_tools({n: {} for n in tool_names})
    template = ChatTemplate(tokenizer, [t.schema for t in tools.values()])
    limits = {"max_turns": 4, "max_response_tokens": 1024, "max_context_tokens": 4096, **limits}
    return AgentContext(engine=engine, template=template, tools=tools,
                        parser=ToolCallParser(tools) if tools else None,
                        sampling_params={"temperature": 1.0, "max_new_tokens": 200}, **limits)


async def run(ctx, loop=tool_agent, messages=QUESTION):
    state = new_state(ctx, ctx.template.prompt_ids(messages), {}, group_id=0)
    return await run_agent(loop, ctx, state)


def model_token_positions(tokenizer, traj, turn_texts):
    """Expected loss_mask from the scripted turns: each turn's canonical ids + EOS, in order."""
    response = traj.response_ids.tolist()
    mask = [0] * len(response)
    pos = 0
    for text in turn_texts:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        while response[pos:pos + len(ids)] != ids:
            pos += 1
            assert pos < len(response), f"turn {text!r} not found in the response"
        mask[pos:pos + len(ids)] = [1] * len(ids)
        pos += len(ids)
    return mask


@pytest.mark.timeout(60)
async def test_multi_turn_ids_equal_full_rendering_and_masks(tokenizer, scripted_engine):
    turns = [call("calculator", expression="48 / 2"),
             "Now both months. " + call("calculator", expression="48 + 24") + "\n" + call("calculator", expression="2 ** 3"),
             "The answer is \\boxed{72}."]
    engine = record_outputs(scripted_engine(lambda ids, k: Reply(turns[k])))
    ctx = make_ctx(tokenizer, engine)
    traj = await run(ctx)
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 3
    assert_engine_inputs_are_prefixes(engine, traj)
    assert traj.loss_mask.tolist() == model_token_positions(tokenizer, traj, turns)
    # What the loop appended between turns: the template's tool messages and assistant header.
    appended = tokenizer.decode(traj.response_ids[traj.loss_mask == 0].tolist())
    assert appended == ("\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n\n<|im_start|>user\n<tool_response>\n72\n</tool_response>\n"
                        "<tool_response>\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Engine logprobs on model tokens, exactly 0.0 elsewhere.
    prompt_len = traj.prompt_ids.numel()
    for r, (m, lp) in enumerate(zip(traj.loss_mask.tolist(), traj.rollout_logprobs.tolist())):
        assert lp == pytest.approx(engine.logprob(prompt_len + r) if m else 0.0)
    assert traj.metadata["tool_calls"] == 3 and traj.metadata["tool_errors"] == 0
    # Every turn went to one session, each input the previous input + output + appended suffix.
    assert len({c["session_id"] for c in engine.calls}) == 1
    full = prompt_len + traj.num_response_tokens
    assert [len(c["input_ids"]) for c in engine.calls][0] == prompt_len
    assert engine.calls[-1]["input_ids"] == (traj.prompt_ids.tolist() + traj.response_ids.tolist())[
        :len(engine.calls[-1]["input_ids"])] and len(engine.calls[-1]["input_ids"]) < full


@pytest.mark.timeout(60)
async def test_malformed_tool_calls_become_observations(tokenizer, scripted_engine):
    bad = ["<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \n</tool_call>",  # bad JSON
           call("search", query="x"),                                   # unknown tool
           call("calculator", expression=7),                            # wrong argument type
           call("calculator", expression="import os"),                  # the tool's own error
           "<tool_call>\n{\"name\": \"calculator\""]                     # never closed
    turns = ["\n".join(bad), "I give up: \\boxed{0}"]
    engine = scripted_engine(lambda ids, k: Reply(turns[k]))
    ctx = make_ctx(tokenizer, engine)
    traj = await run(ctx)
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 2
    assert traj.metadata["tool_calls"] == 5 and traj.metadata["tool_errors"] == 5
    observation = tokenizer.decode(traj.response_ids[traj.loss_mask == 0].tolist())
    for needle in ("not valid JSON", "unknown tool 'search'", "7 is not of type 'string'",
                   "invalid expression", "unterminated tool call"):
        assert needle in observation
    assert observation.count("<tool_response>") == 5


@pytest.mark.timeout(60)
async def test_stop_without_eos_appends_end_of_turn_as_agent_token(tokenizer, scripted_engine):
    # A turn ended by a stop string (no EOS): the template's end-of-turn marker is appended with
    # loss_mask 0.
    turns = [Reply(call("calculator", expression="1 + 1"), eos=False), Reply("\\boxed{2}")]
    engine = record_outputs(scripted_engine(lambda ids, k: turns[k]))
    ctx = make_ctx(tokenizer, engine)
    traj = await run(ctx)
    assert traj.status == RolloutStatus.COMPLETED
    assert_engine_inputs_are_prefixes(engine, traj)
    eos_positions = (traj.response_ids == tokenizer.eos_token_id).nonzero().flatten().tolist()
    # End of the model's first turn (appended), end of the tool turn (template), the final EOS (model).
    assert [traj.loss_mask[p].item() for p in eos_positions] == [0, 0, 1]


@pytest.mark.timeout(60)
async def test_max_turns_truncates(tokenizer, scripted_engine):
    engine = scripted_engine(lambda ids, k: Reply(call("calculator", expression=f"{k} + 1")))
    traj = await run(make_ctx(tokenizer, engine, max_turns=3))
    assert traj.status == RolloutStatus.TRUNCATED and traj.num_turns == 3 and len(engine.calls) == 3
    # The last turn's call is not run: nothing follows the last model turn.
    assert traj.loss_mask[-1] == 1 and traj.metadata["tool_calls"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", ["max_response_tokens", "max_context_tokens"])
async def test_token_limits_truncate_and_cap_each_turn(tokenizer, scripted_engine, limit):
    engine = scripted_engine(lambda ids, k: Reply(call("calculator", expression="12345 * 6789 + 1")))
    probe = make_ctx(tokenizer, engine)
    prompt_len = len(probe.template.prompt_ids(QUESTION))
    budget = 70 if limit == "max_response_tokens" else prompt_len + 70
    ctx = make_ctx(tokenizer, engine, max_turns=50, **{limit: budget})
    traj = await run(ctx)
    assert traj.status == RolloutStatus.TRUNCATED
    assert traj.num_response_tokens <= 70
    for c in engine.calls:  # every turn's max_new_tokens respects what is left
        assert len(c["input_ids"]) - prompt_len + c["params"]["max_new_tokens"] <= 70


@pytest.mark.timeout(60)
async def test_length_finish_ends_without_appending(tokenizer, scripted_engine):
    engine = scripted_engine(lambda ids, k: Reply(call("calculator", expression="1+1") * 20))
    ctx = make_ctx(tokenizer, engine)
    ctx.sampling_params["max_new_tokens"] = 10
    traj = await run(ctx)
    assert traj.status == RolloutStatus.TRUNCATED and traj.num_response_tokens == 10
    assert traj.loss_mask.tolist() == [1] * 10 and traj.metadata["tool_calls"] == 0
    assert traj.metadata["finish_reasons"] == ["length"]


@pytest.mark.timeout(60)
async def test_abort_then_resume_keeps_tokens_and_versions(tokenizer, scripted_engine):
    turns = [Reply(call("calculator", expression="3*4") + " and more words to cut", delay_s=30,
                   weight_version="0"),
             Reply(" rest of the turn", weight_version="1"),
             Reply("\\boxed{12}", weight_version="1")]
    engine = scripted_engine(lambda ids, k: turns[k])
    ctx = make_ctx(tokenizer, engine)
    state = new_state(ctx, ctx.template.prompt_ids(QUESTION), {}, 0)
    import asyncio
    task = asyncio.ensure_future(run_agent(tool_agent, ctx, state))
    await engine.wait_calls(1)  # the first turn is in flight
    await engine.pause("abort")
    first = await task
    assert first.status == RolloutStatus.ABORTED and first.num_turns == 1
    partial = first.num_response_tokens
    assert 0 < partial and first.loss_mask.all()
    await engine.resume()
    traj = await run_agent(tool_agent, ctx, state)
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 2
    assert traj.response_ids[:partial].tolist() == first.response_ids.tolist()
    # The resumed call continued the same turn: its input is prompt + the partial tokens.
    assert engine.calls[1]["input_ids"] == first.prompt_ids.tolist() + first.response_ids.tolist()
    versions = traj.token_policy_versions
    assert versions is not None and versions[:partial].eq(0).all() and versions[partial:].eq(1).all()
    assert traj.policy_version == 0


@pytest.mark.timeout(60)
async def test_engine_error_marks_trajectory(tokenizer, scripted_engine):
    def script(ids, k):
        raise ConnectionError("engine died")
    traj = await run(make_ctx(tokenizer, scripted_engine(script)))
    assert traj.status == RolloutStatus.ERROR and "engine died" in traj.metadata["error"]


@pytest.mark.timeout(60)
async def test_single_turn(tokenizer, scripted_engine):
    engine = record_outputs(scripted_engine(lambda ids, k: Reply(call("calculator", expression="1") + " \\boxed{1}")))
    ctx = make_ctx(tokenizer, engine, tool_names=())
    assert get_agent_loop("single_turn") is single_turn
    traj = await run(ctx, loop=single_turn)
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 1 and len(engine.calls) == 1
    assert traj.loss_mask.all() and traj.metadata["final_text"].endswith("\\boxed{1}")
    assert_engine_inputs_are_prefixes(engine, traj)
    with pytest.raises(ValueError, match="rollout.agent.name"):
        get_agent_loop("nope")


@pytest.mark.timeout(60)
async def test_routed_experts_are_stitched_per_turn_by_position(tokenizer, scripted_engine):
    """R3: each turn asks only for the rows not yet known; prompt, model and tool tokens all get the
    route of the engine forward that read them; the final token (never read) stays -1."""
    turns = [call("calculator", expression="48 / 2"), "The answer is \\boxed{24}."]
    engine = scripted_engine(lambda ids, k: Reply(turns[k]))
    ctx = make_ctx(tokenizer, engine, return_routed_experts=True)
    traj = await run(ctx)
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 2 and traj.metadata["tool_calls"] == 1
    total = traj.prompt_ids.numel() + traj.response_ids.numel()
    expected = torch.tensor([engine.route(p) for p in range(total - 1)], dtype=torch.int32)
    assert traj.routed_experts.shape == (total, 2, 2)
    assert torch.equal(traj.routed_experts[:-1], expected) and traj.routed_experts[-1].eq(-1).all()
    first, second = engine.calls
    assert first["routed_experts_start_len"] == 0
    # turn 2 starts at turn 1's last token: its route (and the tool tokens') come from turn 2's prefill
    turn1_end = len(first["input_ids"]) + len(tokenizer.encode(turns[0], add_special_tokens=False)) + 1
    assert second["routed_experts_start_len"] == turn1_end - 1 < len(second["input_ids"])


@pytest.mark.timeout(60)
async def test_routed_experts_resume_after_an_aborted_turn(tokenizer, scripted_engine):
    """An aborted turn's routes (SGLang returns them for a request aborted while running) are kept: they
    are the sampling-time routes; the resumed turn asks only from the last token sampled before the
    abort on, which its prefill (under the new weights) reads first."""
    engine = scripted_engine(lambda ids, k: Reply("The answer is \\boxed{24}.", delay_s=5.0 if k == 0 else 0.0))
    ctx = make_ctx(tokenizer, engine, tool_names=(), return_routed_experts=True)
    state = new_state(ctx, ctx.template.prompt_ids(QUESTION), {}, group_id=0)
    task = asyncio.create_task(run_agent(single_turn, ctx, state))
    await engine.wait_calls(1)  # the first turn is in flight
    await engine.pause("abort")
    aborted = await task
    assert aborted.status == RolloutStatus.ABORTED and aborted.response_ids.numel() > 0
    total_before = aborted.prompt_ids.numel() + aborted.response_ids.numel()
    assert state.routed_experts.shape[0] == total_before - 1
    await engine.resume()
    traj = await run_agent(single_turn, ctx, state)
    assert engine.calls[1]["routed_experts_start_len"] == total_before - 1
    total = traj.prompt_ids.numel() + traj.response_ids.numel()
    expected = torch.tensor([engine.route(p) for p in range(total - 1)], dtype=torch.int32)
    assert torch.equal(traj.routed_experts[:-1], expected) and traj.routed_experts[-1].eq(-1).all()


@pytest.mark.timeout(60)
async def test_routed_experts_lost_by_an_abort_are_an_error(tokenizer, scripted_engine):
    """An aborted turn that produced tokens but no routes: their sampling-time routes are gone (the
    resumed prefill would report others), so the trajectory is an error, not silently re-routed."""
    engine = scripted_engine(lambda ids, k: Reply("The answer is \\boxed{24}.", delay_s=5.0))
    engine.routes_on_abort = False
    ctx = make_ctx(tokenizer, engine, tool_names=(), return_routed_experts=True)
    task = asyncio.create_task(run(ctx, loop=single_turn))
    await engine.wait_calls(1)  # the turn is in flight
    await engine.pause("abort")
    traj = await task
    assert traj.status == RolloutStatus.ERROR and "routed_experts" in traj.metadata["error"], traj.metadata


@pytest.mark.timeout(60)
async def test_routed_experts_row_count_mismatch_is_an_error(tokenizer, scripted_engine):
    engine = scripted_engine(lambda ids, k: Reply("\\boxed{1}"))
    generate = engine.generate

    async def short_routes(*args, **kwargs):
        out = await generate(*args, **kwargs)
        out.routed_experts = out.routed_experts[1:]
        return out

    engine.generate = short_routes
    traj = await run(make_ctx(tokenizer, engine, tool_names=(), return_routed_experts=True), loop=single_turn)
    assert traj.status == RolloutStatus.ERROR and "routed_experts rows" in traj.metadata["error"]


@pytest.mark.timeout(60)
async def test_routes_kept_as_parts_stitch_to_the_same_tensor(tokenizer, scripted_engine):
    """Engine-facing workers return each call's routes as a part (reference + shape) instead of the
    tensor (megarl.launch.route_workers): the loop stitches parts as it stitches tensors, and the
    parts assembled where they are trained equal the tensor the same conversation stitches."""
    from megarl.rollout.route_parts import RoutePart, RouteParts, assemble

    turns = [call("calculator", expression="48 / 2"), "The answer is \\boxed{24}."]
    reference = await run(make_ctx(tokenizer, scripted_engine(lambda ids, k: Reply(turns[k])),
                                   return_routed_experts=True))
    engine = scripted_engine(lambda ids, k: Reply(turns[k]))
    generate = engine.generate

    async def as_parts(*args, **kwargs):
        out = await generate(*args, **kwargs)
        out.routed_experts = RoutePart(out.routed_experts, tuple(out.routed_experts.shape))  # ref: the tensor itself
        return out

    engine.generate = as_parts
    traj = await run(make_ctx(tokenizer, engine, return_routed_experts=True))
    assert isinstance(traj.routed_experts, RouteParts) and len(traj.routed_experts.parts) == 2
    assert traj.routed_experts.shape == reference.routed_experts.shape
    assert torch.equal(assemble(traj.routed_experts, traj.routed_experts.refs), reference.routed_experts)
    with pytest.raises(ValueError, match="shape"):
        assemble(traj.routed_experts, [r[1:] for r in traj.routed_experts.refs])
