"""The agent loop against the real SGLang CPU server (session fixture ``sglang_engine``).

A random tiny model does not call tools by itself, so turn 1 is forced into a ``python`` tool call
with SGLang's constrained decoding (a ``regex`` in the sampling parameters, xgrammar backend);
later turns sample freely. References are independent of megarl's code: the Hugging Face chat
template rendering of the whole conversation, a transformers teacher-forced forward, and (for the
forced turn, whose logprobs SGLang computes after masking the logits with the grammar) xgrammar's
own matcher replaying the same regex over the transformers logits.
"""
import re

import pytest
import torch

from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
from megarl.rollout.client import SGLangClient
from megarl.rollout.template import ChatTemplate
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.calls import ToolCallParser
from megarl.rollout.types import RolloutStatus

FORCED_CALL = (r'<tool_call>\n\{"name": "python", "arguments": \{"code": '
               r'"print\([1-9][0-9]? \+ [1-9][0-9]?\)"\}\}\n</tool_call>')
QUESTION = [{"role": "user", "content": "Tom has 12 apples and buys 30 more. How many now?"}]
TOLERANCE = 5e-3


class RecordingEngine:
    """Passes calls to the real client and keeps each turn's output (the test's ground truth)."""

    def __init__(self, client):
        self.client, self.outputs = client, []

    async def generate(self, input_ids, sampling_params, **kwargs):
        out = await self.client.generate(input_ids, sampling_params, **kwargs)
        self.outputs.append((list(input_ids), out, dict(sampling_params)))
        return out


def constrained_logprobs(model_logits, tokens, regex, tokenizer, vocab_size):
    """log p(token) under the grammar-masked distribution, replaying xgrammar's matcher."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    out = []
    for row, token in zip(model_logits, tokens):
        matcher.fill_next_token_bitmask(bitmask)
        logits = row.clone().unsqueeze(0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        out.append(torch.log_softmax(logits[0], -1)[token].item())
        assert matcher.accept_token(token)
    return out


@pytest.mark.timeout(300)
async def test_forced_tool_call_trajectory_matches_template_and_transformers(sglang_engine, tiny_moe_hf):
    model, tokenizer = tiny_moe_hf
    tools = build_tools({"python": {"timeout_s": 10}})
    engine = RecordingEngine(SGLangClient(sglang_engine.url))
    ctx = AgentContext(
        engine=engine, template=ChatTemplate(tokenizer, [t.schema for t in tools.values()]),
        tools=tools, parser=ToolCallParser(tools),
        sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 24},
        max_turns=2, max_response_tokens=600, max_context_tokens=4096, return_routed_experts=True,
        turn_sampling_params=lambda turn: {"regex": FORCED_CALL, "max_new_tokens": 200} if turn == 1 else {})
    state = new_state(ctx, ctx.template.prompt_ids(QUESTION), {}, group_id=0)
    try:
        traj = await run_agent(tool_agent, ctx, state)
    finally:
        await engine.client.close()

    # A multi-turn trajectory with an executed tool call whose observation is the program's output.
    assert traj.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED), traj.metadata
    assert traj.num_turns == 2 and traj.metadata["tool_calls"] == 1
    first_out = engine.outputs[0][1]
    assert first_out.finish_reason == "stop" and first_out.output_ids[-1] == tokenizer.eos_token_id
    first_text = tokenizer.decode(first_out.output_ids[:-1])
    a, b = map(int, re.search(r"print\((\d+) \+ (\d+)\)", first_text).groups())
    assert traj.metadata["tool_errors"] == 0

    # loss_mask is 1 exactly on the engine's output tokens, which appear verbatim in order; the
    # tokens between them are the tool observation wrapped by the template (loss_mask 0).
    response = traj.response_ids.tolist()
    prompt_len = traj.prompt_ids.numel()
    expected_mask, segments, pos = [0] * len(response), [], 0
    for input_ids, out, _ in engine.outputs:
        start = len(input_ids) - prompt_len
        assert start >= pos and response[start:start + len(out.output_ids)] == out.output_ids
        if start > pos:
            segments.append(("agent", response[pos:start]))
        segments.append(("model", out.output_ids))
        expected_mask[start:start + len(out.output_ids)] = [1] * len(out.output_ids)
        pos = start + len(out.output_ids)
    assert pos == len(response)
    assert traj.loss_mask.tolist() == expected_mask
    assert traj.rollout_logprobs[traj.loss_mask == 0].eq(0.0).all()

    # The ids equal the tokenisation of the fully rendered conversation. Model segments are kept
    # as sampled (a random model may pick a non-canonical tokenisation of its own text), so they are
    # compared as text and re-encoded; the agent-appended ids must match token for token.
    turn1, turn2 = [ctx.template.decode(ids) for kind, ids in segments if kind == "model"]
    messages = QUESTION + [{"role": "assistant", "content": turn1},
                           {"role": "tool", "content": f"{a + b}\n"},
                           {"role": "assistant", "content": turn2}]
    reference = tokenizer.encode(tokenizer.apply_chat_template(
        messages, tools=[t.schema for t in tools.values()], tokenize=False), add_special_tokens=False)
    canonical = traj.prompt_ids.tolist()
    for kind, ids in segments:
        if kind == "agent":
            canonical += ids
        else:
            eos = [ids[-1]] if ids[-1] == tokenizer.eos_token_id else []
            canonical += tokenizer.encode(ctx.template.decode(ids), add_special_tokens=False) + eos
    assert reference[:len(canonical)] == canonical
    # Beyond the trajectory the rendering only closes the last turn ("<|im_end|>" when it was cut
    # by length) and adds the template's newline.
    assert tokenizer.decode(reference[len(canonical):]) in ("\n", "<|im_end|>\n")

    # Engine logprobs of model tokens == transformers teacher-forced forward (grammar-masked on the
    # forced turn) within 5e-3.
    full = traj.prompt_ids.tolist() + response
    with torch.no_grad():
        hf = model(torch.tensor([full]), output_router_logits=True)
    logits = hf.logits[0].float()
    positions = [prompt_len + r for r, m in enumerate(expected_mask) if m]
    first_positions = positions[:len(first_out.output_ids)]
    forced_ref = constrained_logprobs(logits[[p - 1 for p in first_positions]],
                                      [full[p] for p in first_positions], FORCED_CALL, tokenizer,
                                      model.config.vocab_size)
    free_positions = positions[len(first_out.output_ids):]
    free_ref = torch.log_softmax(logits, -1)[[p - 1 for p in free_positions],
                                             [full[p] for p in free_positions]].tolist()
    engine_lp = traj.rollout_logprobs[traj.loss_mask == 1].tolist()
    diffs = [abs(x - y) for x, y in zip(engine_lp, forced_ref + free_ref)]
    assert len(diffs) == len(positions) and max(diffs) < TOLERANCE, max(diffs)

    # Routed experts: row t is the routing of position t of prompt + response (as the trainer's
    # input token), stitched over both turns; the last token was never fed to the engine (-1).
    # Compare with transformers' router top-k.
    routes = traj.routed_experts
    k = model.config.num_experts_per_tok
    assert routes.shape == (len(full), model.config.num_hidden_layers, k)
    assert routes[-1].eq(-1).all() and routes[:-1].ge(0).all()
    hf_topk = torch.stack([layer.float().topk(k, -1).indices for layer in hf.router_logits], 1)
    hf_routes = hf_topk[:len(full) - 1].sort(-1).values
    agree = (routes[:-1].sort(-1).values == hf_routes).all(-1).float().mean().item()
    assert agree > 0.99, agree
