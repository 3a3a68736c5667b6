"""The agent loop's token stream against SGLang's own chat-completion rendering (issue 28 part 3).

Per model family a real SGLang CPU server runs a tiny model whose tokenizer carries the family's
official chat template (Qwen3, on the same server with ``enable_thinking`` on and off; DeepSeek-V3
with DeepSeek-V3.1's template; GLM-4.5). megarl's agent loop runs one scripted multi-turn
conversation (tool calls with nested unicode JSON arguments, several calls in a turn, an empty and a
multi-line tool output, a final answer; the engine returns fixed token ids, see
``tests/unit/rollout/test_template_properties.py``), and the same conversation up to the last
assistant turn (user message, assistant messages with ``reasoning_content`` and ``tool_calls``, tool
messages, the ``tools`` list) goes to the server's ``POST /v1/chat/completions`` with
``return_prompt_token_ids: true`` (SGLang 0.5.23 ``protocol.ChatCompletionRequest`` and
``serving_chat.py``: the ids the server rendered and fed its scheduler come back in
``choices[0].prompt_token_ids``) and to ``POST /v1/tokenize`` with ``messages`` (the same
``_process_messages``, ``serving_tokenize.py``). Both must equal megarl's stream (the engine input of
the last turn) up to the differences listed in megarl/models/chat_templates/README.md ("Where
SGLang's chat endpoint renders the conversation differently"), applied here to the stream's text:

- ``sglang: tool-defer-loading-null``: SGLang writes ``"defer_loading": null`` into every tool of
  the template's tool list (its ``Tool`` model dumps that field; ``Function`` drops it when unset);
- ``qwen3-no-thinking: earlier-empty-think-dropped``: the template's own history rewrite;
- ``sglang: string-arguments-refused``: DeepSeek's templates concatenate ``function.arguments`` as
  a string; SGLang parses it into a dict first (``normalize_assistant_tool_call_arguments``), so the
  server answers 400. The conversation is then sent as the model wrote it (each assistant turn's text
  as ``content``, no ``tool_calls``), which the template renders token for token.
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "rollout"))  # the scripted engine and conversations

from test_template_properties import FAMILIES, Call, Lookup, Turn, conversation_messages, run_conversation

ENGINE_STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
EMPTY_THINK = "<think>\n\n</think>\n\n"

# Reasoning, several calls per turn with nested unicode JSON arguments (quotes, backslashes, null,
# booleans, lists of objects), an empty and a multi-line output, then an answer. Families whose
# model never reasons (no-thinking modes) get the same turns without reasoning.
TURNS = [
    Turn("Look c1 up first, then c2; ß 中文.", "", (
        Call({"id": "c1", "filter": {"lang": ["中文", "日本"], "score": {"min": -3, "max": None}, "exact": True}},
             "c1: 中文 ok 🙂"),
        Call({"id": "c2", "note": "a \"quote\", a backslash \\ and é"}, "")), eos=True),
    Turn("c2 was empty; one more.", "Checking 🙂", (
        Call({"id": "c3", "path": ["a", {"b": [1, -2, None]}]}, "line 1\nline 2"),), eos=True),
    Turn("Enough.", "c1 says: 中文 ok 🙂", (), eos=True),
]


@dataclass(frozen=True)
class Case:
    """One cross-checked conversation: the property tests' family case (its ``kwargs`` are the
    request's ``chat_template_kwargs``), the tiny model it runs on, and the rewrites between the
    stream and the server's rendering."""
    family_case: str   # a key of test_template_properties.FAMILIES
    model: str         # tiny family of the served model
    template: str      # official template in its tokenizer (megarl/models/chat_templates)
    rewrites: frozenset


CASES = {
    "qwen3-thinking": Case("qwen3-thinking", "qwen3", "qwen3", frozenset({"sglang: tool-defer-loading-null"})),
    "qwen3-no-thinking": Case("qwen3-no-thinking", "qwen3", "qwen3", frozenset({
        "sglang: tool-defer-loading-null", "qwen3-no-thinking: earlier-empty-think-dropped"})),
    "deepseek_v31": Case("deepseek_v31-no-thinking", "deepseek_v3", "deepseek_v31",
                         frozenset({"sglang: string-arguments-refused"})),
    "glm4_moe": Case("glm4_moe", "glm4_moe", "glm4_moe", frozenset({"sglang: tool-defer-loading-null"})),
}


class _Servers:
    """One SGLang server at a time (the cases of a model share it; another model stops it first)."""

    def __init__(self, root: Path):
        self.root = root
        self.models: dict[str, Path] = {}
        self.current = None

    def model_dir(self, case: Case) -> Path:
        from megarl.models.tiny import TinyModelSpec, make_tiny_model

        if case.template not in self.models:
            self.models[case.template] = make_tiny_model(
                self.root / case.template, TinyModelSpec(family=case.model, chat_template=case.template))
        return self.models[case.template]

    def url(self, case: Case) -> str:
        from megarl.rollout.engine_process import EngineProcess

        model_dir = self.model_dir(case)
        if self.current is not None and self.current.model_path != str(model_dir):
            self.stop()
        if self.current is None:
            self.current = EngineProcess(
                model_dir, device="cpu", dtype="float32", mem_fraction_static=0.05, max_total_tokens=4096,
                grammar_backend="none", env={"OMP_NUM_THREADS": "1"}, log_path=self.root / f"{case.template}.log",
                engine_id=f"chat_{case.template}").start()
            self.current.wait_healthy(ENGINE_STARTUP_TIMEOUT_S)
        return self.current.url

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop(grace_s=0)
            self.current = None


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    registry = _Servers(tmp_path_factory.mktemp("chat_endpoint"))
    try:
        yield registry
    finally:
        registry.stop()


# ---------------------------------------------------------------- the conversation as OpenAI messages

def openai_messages(messages: list[dict]) -> list[dict]:
    """The property tests' conversation in the OpenAI wire format: call ids, ``arguments`` as a JSON
    string, tool messages answering their call by id."""
    out, num_calls, unanswered = [], 0, []
    for message in copy.deepcopy(messages):
        for call in message.get("tool_calls") or []:
            call["id"] = f"call_{num_calls}"
            num_calls += 1
            unanswered.append(call["id"])
            if not isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
        if message["role"] == "tool":
            message["tool_call_id"] = unanswered.pop(0)
        out.append(message)
    return out


def raw_text_messages(messages: list[dict], model_texts: list[str]) -> list[dict]:
    """The conversation with each assistant message's content the model's text (its calls in
    the family's own markup) and no ``tool_calls``/``reasoning_content``."""
    texts, out = iter(model_texts), []
    for message in messages:
        if message["role"] == "assistant":
            message = {"role": "assistant", "content": next(texts)}
        out.append(message)
    return out


def _post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=REQUEST_TIMEOUT_S)


def server_prompt_ids(url: str, messages: list[dict], kwargs: dict) -> tuple[list[int], list[int]]:
    """The prompt ids SGLang renders for ``messages`` (with the ``tools`` list): from
    ``/v1/chat/completions`` (``return_prompt_token_ids``, one greedy token) and from ``/v1/tokenize``."""
    body = {"model": "default", "messages": messages, "tools": [Lookup.schema],
            "chat_template_kwargs": kwargs}
    chat = _post(url, "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0.0,
                                               "return_prompt_token_ids": True, "stream": False})
    assert chat.status_code == 200, chat.text
    tokenized = _post(url, "/v1/tokenize", body)
    assert tokenized.status_code == 200, tokenized.text
    return chat.json()["choices"][0]["prompt_token_ids"], tokenized.json()["tokens"]


# ---------------------------------------------------------------- the documented rewrites

def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def stream_rewrites(case: Case, tokenizer, calls: list[dict]) -> list[tuple[int, int, str, str]]:
    """Where ``case``'s rewrites change the text of the last turn's engine input: ``(start, end,
    replacement, name)`` spans of that text, in order. ``calls``: the scripted engine's recorded
    calls (``input_ids``, ``output_ids``)."""
    text = _text(tokenizer, calls[-1]["input_ids"])
    spans = []
    schema = json.dumps(Lookup.schema, ensure_ascii=False)  # as transformers' tojson writes it
    if schema in text:
        assert text.count(schema) == 1
        start = text.index(schema)
        spans.append((start, start + len(schema), json.dumps({**Lookup.schema, "defer_loading": None},
                                                             ensure_ascii=False), "sglang: tool-defer-loading-null"))
    if case.family_case == "qwen3-no-thinking":  # earlier generation prompts lose their empty think block
        for call in calls[:-1]:
            end = len(_text(tokenizer, call["input_ids"]))
            assert text[:end].endswith(EMPTY_THINK)
            spans.append((end - len(EMPTY_THINK), end, "", "qwen3-no-thinking: earlier-empty-think-dropped"))
    return sorted(spans)


def apply_rewrites(text: str, spans: list[tuple[int, int, str, str]]) -> str:
    """``text`` with each span replaced."""
    out, at = [], 0
    for start, end, replacement, _ in spans:
        out += [text[at:start], replacement]
        at = end
    return "".join(out) + text[at:]


# ---------------------------------------------------------------- the cross-check

@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_stream_matches_sglang_chat_rendering(name, servers):
    from transformers import AutoTokenizer

    case = CASES[name]
    family = FAMILIES[case.family_case]
    turns = [t if family.thinking == "optional" else Turn(None, t.content, t.calls, t.eos) for t in TURNS]
    tokenizer = AutoTokenizer.from_pretrained(servers.model_dir(case))
    run = run_conversation(tokenizer, family, turns)
    calls = run.engine.calls
    assert run.traj.metadata["tool_calls"] == 3 and run.traj.metadata["tool_errors"] == 0
    stream = calls[-1]["input_ids"]  # the prompt of the last assistant turn, as the loop built it
    assert tokenizer.encode(tokenizer.decode(stream, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                            add_special_tokens=False) == stream
    messages = openai_messages(conversation_messages(family, turns[:-1], run.observations))
    url = servers.url(case)
    fired = set()

    if "sglang: string-arguments-refused" in case.rewrites:
        # The official rendering of the OpenAI-style conversation (string arguments) is the stream ...
        reference = tokenizer.apply_chat_template(messages, tools=[Lookup.schema], tokenize=False,
                                                  add_generation_prompt=True, **family.kwargs)
        assert tokenizer.encode(reference, add_special_tokens=False) == stream
        # ... but SGLang turns the arguments into dicts before rendering, which the template cannot add.
        refused = _post(url, "/v1/chat/completions", {"model": "default", "messages": messages,
                                                      "tools": [Lookup.schema], "max_tokens": 1})
        assert refused.status_code == 400, refused.text
        assert refused.json()["message"] == 'can only concatenate str (not "dict") to str'
        fired.add("sglang: string-arguments-refused")
        # The same conversation as the model wrote it renders as the stream, token for token.
        texts = [tokenizer.decode(c["output_ids"][:-1], skip_special_tokens=False) for c in calls[:-1]]
        messages = raw_text_messages(messages, texts)

    chat_ids, tokenize_ids = server_prompt_ids(url, messages, family.kwargs)
    assert tokenize_ids == chat_ids  # both endpoints render through the same _process_messages
    spans = stream_rewrites(case, tokenizer, calls)
    fired |= {name for *_, name in spans}
    assert fired == case.rewrites
    text = _text(tokenizer, stream)
    assert chat_ids == tokenizer.encode(apply_rewrites(text, spans), add_special_tokens=False)
    if not spans:
        assert chat_ids == stream
        return
    # Token ids, not only text: before the first rewrite and after the last, the server's ids are the stream's.
    same_head = next((k for k, (a, b) in enumerate(zip(chat_ids, stream)) if a != b), len(stream))
    same_tail = next((k for k, (a, b) in enumerate(zip(chat_ids[::-1], stream[::-1])) if a != b), len(stream))
    assert len(_text(tokenizer, stream[:same_head])) >= spans[0][0]
    assert len(_text(tokenizer, stream[len(stream) - same_tail:])) >= len(text) - spans[-1][1]
