"""Token streams proven per official chat template (issue 28 part 3), by property tests.

``hypothesis`` draws conversations (1-6 model turns; tool calls with nested unicode JSON arguments,
several per turn; empty, short and over-long tool outputs; malformed calls; reasoning present or
absent; turns ended by EOS or by a stop string), the family's model text of each turn is replayed by
a scripted engine through the real agent loop (:func:`megarl.rollout.agent.tool_agent`, the family's
SGLang reasoning parser and tool-call detector), and for each template:

(a) every generate call's input is a token prefix of the next (and of the final stream);
(b) ``loss_mask`` is 1 exactly on the tokens the engine returned;
(c) the final stream is the template's own rendering of the same conversation (``apply_chat_template``
    of the OpenAI-style messages: answer, ``reasoning_content``, ``tool_calls``, tool messages),
    token for token, except for the rewrites listed per template in ``REWRITES`` (each named in
    megarl/models/chat_templates/README.md): the stream with exactly those rewrites applied equals
    the rendering's text, and the stream's ids are the one-pass tokenisation of its own text;
(d) the tokenizer work between two generate calls is bounded by that turn's own tokens (the suffix
    encoded once, the turn decoded once, the anchor + the turn's tool messages rendered): nothing of
    the history is re-rendered or re-tokenised.

Examples are bounded (``MAX_EXAMPLES`` per template) and derandomised, so CI is reproducible.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from rollout_scripted import Reply, ScriptedEngine
from turn_checks import assert_engine_inputs_are_prefixes, record_outputs

from megarl.rollout import agent as agent_module
from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
from megarl.rollout.template import build_template
from megarl.rollout.types import RolloutStatus

MAX_EXAMPLES = 100
MAX_TOOL_OUTPUT_CHARS = 3000
QUESTION = [{"role": "user", "content": "Look up c1 and tell me what it says, 中文 ok?"}]
README = Path(__file__).resolve().parents[3] / "megarl/models/chat_templates/README.md"


# ---------------------------------------------------------------- conversations

@dataclass(frozen=True)
class Call:
    """A well-formed call of the ``lookup`` tool; ``output`` is what the tool returns."""
    arguments: dict
    output: str


@dataclass(frozen=True)
class Malformed:
    """A call the detector rejects: ``bad_json``, ``unknown_tool`` or ``unterminated`` (last only)."""
    kind: str


@dataclass(frozen=True)
class Turn:
    reasoning: str | None
    content: str
    calls: tuple  # of Call, or of Malformed (a turn is well-formed or not, see conversation_messages)
    eos: bool      # ended by the model's EOS (True) or by a stop string (False: no end token)


# Text without markup ("<", ">"), without leading/trailing whitespace (the templates strip it: see
# the README), with unicode, quotes, backslashes and inner newlines.
_CHARS = list("abcxyzABC019 .,;:!?()[]{}\"'\\/-_+=*#@$%&|~\néßΩ中文日本🙂")
plain = st.text(st.sampled_from(_CHARS), max_size=30).map(str.strip)
words = plain.filter(bool)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | plain,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words.filter(lambda k: k != "id"), inner, max_size=3),
    max_leaves=8)
outputs = st.one_of(st.just(""), plain,  # empty, short, and longer than MAX_TOOL_OUTPUT_CHARS (cut by the loop)
                    st.builds(lambda unit, n: (unit or "x") * n, words, st.integers(400, 700)))


@st.composite
def conversations(draw, *, thinking: str):
    """Turns of one trajectory: every turn but the last calls tools; ``thinking``: ``never``,
    ``optional`` (reasoning present or absent per turn)."""
    num_turns = draw(st.integers(1, 6))
    turns, next_id = [], 1
    for k in range(num_turns):
        last = k == num_turns - 1
        reasoning = draw(st.none() | words) if thinking == "optional" else None
        content = draw(plain)
        if last:
            calls = ()
        elif draw(st.integers(0, 4)) == 0:  # one turn in five writes broken calls only
            kinds = draw(st.lists(st.sampled_from(["bad_json", "unknown_tool"]), min_size=0, max_size=2))
            if draw(st.booleans()) or not kinds:
                kinds.append("unterminated")
            calls = tuple(Malformed(kind) for kind in kinds)
        else:
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                extra = draw(st.dictionaries(words.filter(lambda k: k != "id"), json_values, max_size=3))
                calls.append(Call({"id": f"c{next_id}", **extra}, draw(outputs)))
                next_id += 1
            calls = tuple(calls)
        turns.append(Turn(reasoning, content, calls, eos=draw(st.booleans())))
    return turns


# ---------------------------------------------------------------- the lookup tool

class Lookup:
    """Returns the scripted output of call ``id`` (calls run concurrently: looked up, not queued)."""

    name = "lookup"
    schema = {"type": "function", "function": {
        "name": "lookup", "description": "Look a record up by id.",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}

    def __init__(self):
        self.outputs: dict[str, str] = {}

    async def __call__(self, arguments):
        return self.outputs[arguments["id"]]


# ---------------------------------------------------------------- families: what the model writes

def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # what the templates' tojson writes


@dataclass(frozen=True)
class Family:
    """How a template's model writes a turn, and the rewrites its rendering makes (REWRITES)."""
    template: str
    kwargs: dict
    thinking: str                 # "never" | "optional"
    prompt_opens_reasoning: bool  # the generation prompt ends inside <think>

    def turn_text(self, turn: Turn, first: bool) -> str:
        """The model's text of ``turn`` (``first``: the first turn, after the prompt's generation prompt)."""
        return self.reasoning_text(turn, first) + self.answer_text(turn)

    def reasoning_text(self, turn: Turn, first: bool) -> str:
        """The reasoning the turn starts with ("" for none; the close alone where the prompt opened it)."""
        if self.template == "glm4_moe":
            return "" if turn.reasoning is None else "\n<think>" + turn.reasoning + "</think>"
        open_, close = {"qwen3": ("<think>\n", "\n</think>\n\n"), "deepseek_r1": ("<think>\n", "\n</think>\n\n"),
                        "deepseek_v31": ("<think>", "</think>")}[self.template]
        opened = first and self.prompt_opens_reasoning
        if turn.reasoning is None:
            return close if opened else ""
        return ("" if opened else open_) + turn.reasoning + close

    def answer_text(self, turn: Turn) -> str:
        """The turn's text after its reasoning: content and calls."""
        return getattr(self, "_" + self.template)(turn)

    def end_of_turn(self, turn: Turn) -> tuple[str, bool]:
        """(text appended to the turn, Reply.eos): GLM-4.5 stops on <|observation|> / <|user|>."""
        if self.template == "glm4_moe":
            return ("<|observation|>" if turn.calls else "<|user|>") if turn.eos else "", False
        return "", turn.eos

    def _qwen3(self, turn: Turn) -> str:
        text = turn.content
        for i, call in enumerate(turn.calls):
            text += "\n" if (i or turn.content) else ""
            text += self._malformed_qwen(call) if isinstance(call, Malformed) else (
                '<tool_call>\n{"name": "lookup", "arguments": ' + _json(call.arguments) + "}\n</tool_call>")
        return text

    @staticmethod
    def _malformed_qwen(call: Malformed) -> str:
        return {"bad_json": '<tool_call>\n{"name": "lookup", "arguments": {"id": \n</tool_call>',
                "unknown_tool": '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
                "unterminated": '<tool_call>\n{"name": "lookup"'}[call.kind]

    def _deepseek(self, turn: Turn, call_text) -> str:
        text = turn.content
        if not turn.calls:
            return text
        bodies = [self._malformed_deepseek(c) if isinstance(c, Malformed) else call_text(c) for c in turn.calls]
        sep = "\n" if self.template == "deepseek_r1" else ""
        text += "<｜tool▁calls▁begin｜>" + sep.join(bodies)
        return text if isinstance(turn.calls[-1], Malformed) and turn.calls[-1].kind == "unterminated" \
            else text + "<｜tool▁calls▁end｜>"

    def _malformed_deepseek(self, call: Malformed) -> str:
        head = "<｜tool▁call▁begin｜>" + ("" if self.template == "deepseek_v31" else "function<｜tool▁sep｜>")
        fence = ("<｜tool▁sep｜>{0}", "{0}") if self.template == "deepseek_v31" else ("\n```json\n{0}\n```", "{0}")
        def name_then(name, args):
            return head + name + fence[0].format(args)
        return {"bad_json": name_then("lookup", '{"id": ') + "<｜tool▁call▁end｜>",
                "unknown_tool": name_then("search", '{"q": "x"}') + "<｜tool▁call▁end｜>",
                "unterminated": name_then("lookup", '{"id": "c0"}')}[call.kind]

    def _deepseek_r1(self, turn: Turn) -> str:
        return self._deepseek(turn, lambda c: "<｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n```json\n"
                              + _json(c.arguments) + "\n```<｜tool▁call▁end｜>")

    def _deepseek_v31(self, turn: Turn) -> str:
        return self._deepseek(turn, lambda c: "<｜tool▁call▁begin｜>lookup<｜tool▁sep｜>"
                              + _json(c.arguments) + "<｜tool▁call▁end｜>")

    def _glm4_moe(self, turn: Turn) -> str:
        text = "\n" + turn.content if turn.content else ""
        for call in turn.calls:
            if isinstance(call, Malformed):
                text += {"bad_json": "\n<tool_call>lookup\n<arg_key>id</arg_key>\n</tool_call>",
                         "unknown_tool": "\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>"
                                         "\n</tool_call>",
                         "unterminated": "\n<tool_call>lookup\n<arg_key>id</arg_key>"}[call.kind]
                continue
            text += "\n<tool_call>lookup\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _json(v)}</arg_value>\n"
                for k, v in call.arguments.items()) + "</tool_call>"
        return text


FAMILIES = {
    "qwen3-thinking": Family("qwen3", {}, "optional", False),
    "qwen3-no-thinking": Family("qwen3", {"enable_thinking": False}, "never", False),
    "deepseek_r1": Family("deepseek_r1", {}, "optional", True),
    "deepseek_v31-thinking": Family("deepseek_v31", {"thinking": True}, "optional", True),
    "deepseek_v31-no-thinking": Family("deepseek_v31", {}, "never", False),
    "glm4_moe": Family("glm4_moe", {}, "optional", False),
}


# ---------------------------------------------------------------- running one conversation

class CountingTokenizer:
    """The tokenizer, counting what the agent loop makes it do (tokens encoded and decoded, messages
    rendered); everything else is the tokenizer's own."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded_tokens = self.decoded_tokens = self.rendered_messages = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, **kwargs):
        ids = self._tokenizer.encode(text, **kwargs)
        self.encoded_tokens += len(ids)
        return ids

    def decode(self, ids, **kwargs):
        self.decoded_tokens += len(ids)
        return self._tokenizer.decode(ids, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.rendered_messages += len(messages)
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def counters(self) -> tuple[int, int, int]:
        return self.encoded_tokens, self.decoded_tokens, self.rendered_messages


@dataclass
class Run:
    traj: object
    engine: ScriptedEngine
    observations: list   # per turn with calls: the ToolResults the loop appended
    work: list           # tokenizer counters at each generate call and at the end
    texts: list          # the model text of each turn (as the engine returned it)


def run_conversation(tokenizer, family: Family, turns: list[Turn]) -> Run:
    lookup = Lookup()
    lookup.outputs = {c.arguments["id"]: c.output for t in turns for c in t.calls if isinstance(c, Call)}
    tools = {"lookup": lookup}
    agent = SimpleNamespace(system_prompt=None, reasoning_parser="auto", tool_call_parser="auto",
                            chat_template_kwargs=family.kwargs)
    chat, parser = build_template(tokenizer, agent, tools)
    texts = [family.turn_text(t, k == 0) + family.end_of_turn(t)[0] for k, t in enumerate(turns)]
    counting, work = CountingTokenizer(tokenizer), []

    def script(input_ids, k):
        work.append(counting.counters())
        return Reply(texts[k], eos=family.end_of_turn(turns[k])[1])

    engine = record_outputs(ScriptedEngine(tokenizer, script))
    ctx = AgentContext(engine=engine, template=chat, tools=tools, parser=parser, max_turns=len(turns),
                       max_response_tokens=10**6, max_context_tokens=10**6,
                       max_tool_output_chars=MAX_TOOL_OUTPUT_CHARS, sampling_params={"max_new_tokens": 10**6})
    state = new_state(ctx, chat.prompt_ids(QUESTION), {}, group_id=0)
    chat.tokenizer = counting  # count from the first turn on (the prompt is rendered once, above)
    observations, run_tool_calls = [], agent_module.run_tool_calls

    async def recording(calls, *args, **kwargs):
        results = await run_tool_calls(calls, *args, **kwargs)
        observations.append(results)
        return results

    with mock.patch.object(agent_module, "run_tool_calls", recording):
        traj = asyncio.run(run_agent(tool_agent, ctx, state))
    work.append(counting.counters())
    return Run(traj, engine, observations, work, texts)


def conversation_messages(family: Family, turns: list[Turn], observations: list) -> list[dict]:
    """The OpenAI-style conversation the trajectory is: per turn the answer (``content``), the
    reasoning (``reasoning_content``) and the well-formed calls (``tool_calls``; a turn of malformed
    calls keeps them in its content), then the tool messages the loop appended."""
    messages, results = list(QUESTION), iter(observations)
    for turn in turns:
        good = [c for c in turn.calls if isinstance(c, Call)]
        answer = turn.content if good else family.answer_text(turn)
        message = {"role": "assistant", "content": answer}
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if good:
            as_string = family.template.startswith("deepseek")  # their templates concatenate a string
            message["tool_calls"] = [{"type": "function", "function": {
                "name": "lookup", "arguments": _json(c.arguments) if as_string else c.arguments}} for c in good]
        messages.append(message)
        if turn.calls:
            messages += [{"role": "tool", "content": r.text} for r in next(results)]
    return messages


# ---------------------------------------------------------------- (c): the template's own rewrites

REWRITES: dict[str, tuple[str, ...]] = {
    # case -> the rewrites its template's rendering may make; each is described in the README's table
    "qwen3-thinking": ("final-empty-think", "final-closed", "final-newline"),
    "qwen3-no-thinking": ("earlier-empty-think-dropped", "final-closed", "final-newline"),
    "deepseek_r1": ("reasoning-dropped", "later-calls-merged", "first-calls-after-outputs", "later-outputs-unopened",
                    "final-closed"),
    "deepseek_v31-thinking": ("reasoning-dropped", "final-closed"),
    "deepseek_v31-no-thinking": ("final-closed",),
    "glm4_moe": ("empty-think-written", "final-stop-dropped"),
}


def _cut(text: str, prefix: str) -> str:
    assert text.startswith(prefix), (text[:80], prefix)
    return text[len(prefix):]


def _cut_end(text: str, suffix: str) -> str:
    assert text.endswith(suffix), (text[-80:], suffix)
    return text[:len(text) - len(suffix)]


def template_view(case: str, family: Family, turns: list[Turn], before: list[str], model: list[str]) -> tuple[str, set]:
    """The stream's text with ``case``'s rewrites applied, and the names of those that changed it.

    Args:
        before: the text before each model turn that the loop did not generate (the prompt, then
            what the loop appended after each turn), ``before[k]`` ending where turn ``k`` starts.
        model: each turn's text as the engine returned it (its EOS included).
    """
    before, model, fired = list(before), list(model), set()
    last = len(turns) - 1

    def rewrite(name, ok=True):
        if ok:
            fired.add(name)
        return ok

    if family.template == "qwen3":
        empty = "<think>\n\n</think>\n\n"
        if case == "qwen3-no-thinking":
            for k in range(last):
                before[k] = _cut_end(before[k], empty)
                rewrite("earlier-empty-think-dropped")
        elif rewrite("final-empty-think", turns[last].reasoning is None):
            model[last] = empty + model[last]
        if rewrite("final-closed", not turns[last].eos):
            model[last] += "<|im_end|>"
        model[last] += "\n"
        rewrite("final-newline")
    elif family.template.startswith("deepseek"):
        for k in range(len(turns)):
            if rewrite("reasoning-dropped", bool(family.reasoning_text(turns[k], k == 0))):
                model[k] = _cut(model[k], family.reasoning_text(turns[k], k == 0))
        if case == "deepseek_v31-thinking":
            before[0] = _cut_end(before[0], "<think>") + "</think>"
        if case == "deepseek_r1":
            before[0] = _cut_end(before[0], "<think>\n")
            calling = [k for k, t in enumerate(turns) if any(isinstance(c, Call) for c in t.calls)]
            for k in calling:
                if k == 0:
                    continue
                before[k] = _cut_end(before[k], "<｜tool▁outputs▁end｜>")
                if rewrite("later-calls-merged", k != calling[0]):
                    model[k] = "\n" + _cut(model[k], turns[k].content + "<｜tool▁calls▁begin｜>")
                else:
                    model[k] = "<｜Assistant｜>" + model[k]
                    rewrite("first-calls-after-outputs")
            for k in range(2, len(turns)):
                before[k] = before[k].replace("<｜tool▁outputs▁begin｜>", "")
                rewrite("later-outputs-unopened")
        if rewrite("final-closed", not turns[last].eos):
            model[last] += "<｜end▁of▁sentence｜>"
    else:  # glm4_moe
        for k, turn in enumerate(turns):
            if rewrite("empty-think-written", turn.reasoning is None):
                model[k] = "\n<think></think>" + model[k]
        if rewrite("final-stop-dropped", turns[last].eos):
            model[last] = _cut_end(model[last], "<|user|>")
    return "".join(b + m for b, m in zip(before, model)), fired


# ---------------------------------------------------------------- the properties

def _expected_observations(turn: Turn) -> list[str] | None:
    """What the tool returns for each well-formed call, as the loop cuts it (None: malformed turn)."""
    if not turn.calls or isinstance(turn.calls[0], Malformed):
        return None
    cut = MAX_TOOL_OUTPUT_CHARS
    return [c.output if len(c.output) <= cut else c.output[:cut] + "\n[truncated]" for c in turn.calls]


def check_conversation(tokenizer, case: str, turns: list[Turn]) -> None:
    family = FAMILIES[case]
    run = run_conversation(tokenizer, family, turns)
    traj, calls = run.traj, run.engine.calls
    assert traj.status == RolloutStatus.COMPLETED, traj.metadata.get("error")
    assert traj.num_turns == len(turns) == len(calls)
    # (a) and (b): each input is a prefix of the next and of the stream, outputs where they were
    # generated, loss_mask 1 exactly on them.
    assert_engine_inputs_are_prefixes(run.engine, traj)
    # The tools saw the calls the model wrote: outputs as scripted, malformed calls as errors.
    tool_turns = [t for t in turns if t.calls]
    assert len(run.observations) == len(tool_turns)
    for turn, results in zip(tool_turns, run.observations):
        expected = _expected_observations(turn)
        if expected is None:
            assert len(results) == len(turn.calls) and all(r.is_error for r in results)
        else:
            assert [r.text for r in results] == expected and not any(r.is_error for r in results)
    # (c) the stream is the one-pass tokenisation of its own text, and that text is the template's
    # rendering of the conversation up to the template's own rewrites (REWRITES).
    stream = traj.prompt_ids.tolist() + traj.response_ids.tolist()

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    assert tokenizer.encode(text(stream), add_special_tokens=False) == stream, "incremental ids != one-pass ids"
    ends = [len(c["input_ids"]) + len(c["output_ids"]) for c in calls]
    before = [text(c["input_ids"][start:]) for c, start in zip(calls, [0] + ends[:-1])]
    model = [text(c["output_ids"]) for c in calls]
    assert model == [text(tokenizer.encode(t, add_special_tokens=False)) + (
        text([tokenizer.eos_token_id]) if family.end_of_turn(turn)[1] else "") for t, turn in zip(run.texts, turns)]
    messages = conversation_messages(family, turns, run.observations)
    rendering = tokenizer.apply_chat_template(messages, tools=[Lookup.schema], tokenize=False, **family.kwargs)
    view, fired = template_view(case, family, turns, before, model)
    assert fired <= set(REWRITES[case])
    for name in sorted(fired):
        event(f"rewrite {name}")  # --hypothesis-show-statistics: how often each rewrite was exercised
    assert view == rendering
    if not fired:
        assert tokenizer.encode(rendering, add_special_tokens=False) == stream
    # (d) between two generate calls the loop encodes only the appended suffix, decodes only the
    # turn (and its end token) and renders only the anchor and the turn's tool messages.
    for k, call in enumerate(calls):
        (enc0, dec0, msg0), (enc1, dec1, msg1) = run.work[k], run.work[k + 1]
        appended = len(calls[k + 1]["input_ids"]) - ends[k] if k + 1 < len(calls) else 0
        num_tool_messages = len(run.observations[sum(bool(t.calls) for t in turns[:k])]) if turns[k].calls else 0
        assert enc1 - enc0 == appended
        assert dec1 - dec0 <= len(call["output_ids"]) + 1
        assert msg1 - msg0 == (2 + num_tool_messages if turns[k].calls else 0)


_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])
_LONG = "ß中🙂" * 1200  # cut by the loop at MAX_TOOL_OUTPUT_CHARS
# Regression/coverage examples every run has, whatever hypothesis draws: several calls with nested
# unicode arguments, empty and over-long outputs, a malformed turn before calling turns (DeepSeek-R1's
# first-calls-after-outputs), turns ended by stop strings, and a last turn without reasoning.
_EXAMPLES = [
    [Turn("plan ß", "", (Call({"id": "c1", "q": {"a": [1, None, "中"]}}, ""), Call({"id": "c2"}, _LONG)), eos=False),
     Turn(None, "", (Malformed("bad_json"), Malformed("unterminated")), eos=True),
     Turn("again", "two 🙂", (Call({"id": "c3", "k": True}, "x\ny"),), eos=True),
     Turn(None, "done", (Call({"id": "c4"}, "ok"),), eos=False),
     Turn(None, "The answer: 🙂", (), eos=False)],
    [Turn(None, "", (Malformed("unknown_tool"),), eos=False),
     Turn("r", "", (Call({"id": "c1", "nested": {"deep": {"deeper": ["é", {"x": -1}]}}}, "out"),), eos=True),
     Turn("last", "ok", (), eos=True)],
]


def _property_test(case, examples):
    thinking = FAMILIES[case].thinking

    def adapt(turns):  # the examples' reasoning dropped for templates whose model never reasons
        return [Turn(t.reasoning if thinking == "optional" else None, t.content, t.calls, t.eos) for t in turns]

    @_SETTINGS
    @given(turns=conversations(thinking=thinking))
    def test(official_template_tokenizers, turns):
        check_conversation(official_template_tokenizers[FAMILIES[case].template], case, turns)

    for turns in examples:
        test = example(turns=adapt(turns))(test)
    return pytest.mark.timeout(600)(test)


test_qwen3_thinking = _property_test("qwen3-thinking", _EXAMPLES)
test_qwen3_no_thinking = _property_test("qwen3-no-thinking", _EXAMPLES)
test_deepseek_r1 = _property_test("deepseek_r1", _EXAMPLES)
test_deepseek_v31_thinking = _property_test("deepseek_v31-thinking", _EXAMPLES)
test_deepseek_v31_no_thinking = _property_test("deepseek_v31-no-thinking", _EXAMPLES)
test_glm4_moe = _property_test("glm4_moe", _EXAMPLES)


def test_every_rewrite_is_documented():
    """Each rewrite the property tests allow is named in the templates' fixture doc."""
    readme = README.read_text()
    for case, rewrites in REWRITES.items():
        for name in rewrites:
            assert f"`{case}: {name}`" in readme, f"{case}: {name} missing from {README.name}"
