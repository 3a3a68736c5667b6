#!/usr/bin/env python
"""Benchmark the agent loop against the real SGLang server.

(a) Throughput: N concurrent single-turn requests through the agent loop (``single_turn`` with
    megarl's SGLang client) vs the same requests posted straight to SGLang's ``/generate`` with a
    bare aiohttp session, interleaved in the same run. Output: generated tokens/s of each and the
    ratio agent / direct (target >= 0.95).
(b) Orchestration cost per turn: the agent loop's own time per turn (decode, tool-call parsing,
    suffix tokenisation, bookkeeping: wall time minus engine and tool time) with 1k vs 32k tokens
    of history. Every turn is forced into a calculator call (regex constraint) so each turn goes
    through the whole path. Output: median ms per turn at each length and the ratio (target <= 1.1).

Usage::

    python tools/benchmarks/agent_loop.py                       # tiny model, CPU server launched here
    python tools/benchmarks/agent_loop.py --url http://host:port --model DIR   # a running server

``--model`` must hold a context of at least ``--long-history + 2k`` tokens; the default tiny model
is made with ``max_position_embeddings=40960``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.rollout.agent import AgentContext, new_state, run_agent, single_turn, tool_agent
from megarl.rollout.client import SGLangClient
from megarl.rollout.template import ChatTemplate
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.calls import ToolCallParser

CALL_REGEX = (r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
              r'"[1-9][0-9] \+ [1-9][0-9]"\}\}\n</tool_call>')


def questions(n: int) -> list[str]:
    from megarl.models.tiny_tokenizer import gsm8k_texts

    texts = gsm8k_texts()
    return [next(texts) for _ in range(2 * n)][::2][:n]


async def direct_generate(url: str, prompts: list[list[int]], params: dict) -> int:
    """Post every prompt at once to /generate; return the generated tokens."""
    async with aiohttp.ClientSession() as session:
        async def one(ids):
            payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
            async with session.post(url + "/generate", json=payload) as resp:
                return len((await resp.json())["output_ids"])
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def agent_generate(client: SGLangClient, ctx: AgentContext, prompts: list[list[int]]) -> int:
    states = [new_state(ctx, p, {}, group_id=i) for i, p in enumerate(prompts)]
    trajs = await asyncio.gather(*(run_agent(single_turn, ctx, s) for s in states))
    return sum(t.num_model_tokens for t in trajs)


async def throughput(url: str, tokenizer, n: int, new_tokens: int, rounds: int) -> dict:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    client = SGLangClient(url)
    ctx = AgentContext(engine=client, template=ChatTemplate(tokenizer, []),
                       sampling_params=params, max_response_tokens=new_tokens,
                       max_context_tokens=10 ** 6)
    prompts = [ctx.template.prompt_ids([{"role": "user", "content": q}]) for q in questions(n)]
    await direct_generate(url, prompts[:4], {**params, "max_new_tokens": 8})  # warm up
    rates = {"direct": [], "agent": []}
    cpu_ms = {"direct": [], "agent": []}  # this process's CPU per request: load-independent
    try:
        for r in range(rounds):
            for name in (("direct", "agent") if r % 2 == 0 else ("agent", "direct")):  # ABBA
                await client.flush_cache()  # both start from a cold prefix cache
                start, cpu_start = time.monotonic(), time.process_time()
                tokens = await (direct_generate(url, prompts, params) if name == "direct"
                                else agent_generate(client, ctx, prompts))
                rates[name].append(tokens / (time.monotonic() - start))
                cpu_ms[name].append(1e3 * (time.process_time() - cpu_start) / n)
    finally:
        await client.close()
    # Paired ratios (same round, back to back) are robust to load drifting over the run.
    ratios = [a / d for a, d in zip(rates["agent"], rates["direct"])]
    return {"n_requests": n, "new_tokens": new_tokens, "rounds": rounds,
            "direct_tokens_per_s": statistics.median(rates["direct"]),
            "agent_tokens_per_s": statistics.median(rates["agent"]),
            "ratio": statistics.median(ratios),
            "client_cpu_ms_per_request": {k: statistics.median(v) for k, v in cpu_ms.items()},
            "all_rates": rates}


async def orchestration(url: str, tokenizer, history_tokens: int, turns: int, reps: int) -> dict:
    tools = build_tools({"calculator": {}})
    client = SGLangClient(url)
    ctx = AgentContext(
        engine=client, template=ChatTemplate(tokenizer, [t.schema for t in tools.values()]),
        tools=tools, parser=ToolCallParser(tools), max_turns=turns,
        sampling_params={"temperature": 1.0, "max_new_tokens": 120},
        turn_sampling_params=lambda turn: {"regex": CALL_REGEX},
        max_response_tokens=10 ** 6, max_context_tokens=10 ** 6)
    filler = " ".join(questions(400))
    text = filler
    while len(tokenizer.encode(text, add_special_tokens=False)) < history_tokens:
        text += " " + filler
    ids = tokenizer.encode(text, add_special_tokens=False)[:history_tokens]
    prompt = ctx.template.prompt_ids([{"role": "user", "content": tokenizer.decode(ids)}])
    per_turn_ms = []
    try:
        for _ in range(reps):
            traj = await run_agent(tool_agent, ctx, new_state(ctx, prompt, {}, 0))
            assert traj.metadata["tool_calls"] == turns - 1, traj.metadata
            per_turn_ms.append(1e3 * traj.metadata["orchestration_s"] / traj.num_turns)
    finally:
        await client.close()
    return {"history_tokens": len(prompt), "turns": turns, "reps": reps,
            "orchestration_ms_per_turn_median": statistics.median(per_turn_ms),
            "orchestration_ms_per_turn_min": min(per_turn_ms), "all_ms_per_turn": per_turn_ms}


def launch(model: str | None, workdir: str):
    from megarl.models.tiny import TinyModelSpec, make_tiny_model
    from megarl.rollout.engine_process import EngineProcess

    if model is None:
        model = str(make_tiny_model(Path(workdir) / "tiny_moe_long",
                                    TinyModelSpec(max_position_embeddings=40960)))
    engine = EngineProcess(model, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=80000, grammar_backend="xgrammar",
                           env={"OMP_NUM_THREADS": "1"}, log_path=Path(workdir) / "engine.log")
    return engine.start().wait_healthy(300), model


def report(result: dict) -> None:
    """Print one line per benchmark."""
    if "a_throughput" in result:
        a = result["a_throughput"]
        print(f"(a) {a['n_requests']} concurrent single-turn requests x {a['new_tokens']} tokens: "
              f"direct /generate {a['direct_tokens_per_s']:.0f} tok/s, agent loop "
              f"{a['agent_tokens_per_s']:.0f} tok/s (medians), paired ratio {a['ratio']:.3f} "
              f"(target >= 0.95); client CPU per request: direct "
              f"{a['client_cpu_ms_per_request']['direct']:.2f} ms, agent "
              f"{a['client_cpu_ms_per_request']['agent']:.2f} ms")
    if "b_orchestration" in result:
        b = result["b_orchestration"]
        short, long = b["short"], b["long"]
        print(f"(b) orchestration per turn: {short['history_tokens']} tokens of history "
              f"{short['orchestration_ms_per_turn_median']:.2f} ms, {long['history_tokens']} tokens "
              f"{long['orchestration_ms_per_turn_median']:.2f} ms (medians; ratio {b['ratio']:.3f}); "
              f"minima {short['orchestration_ms_per_turn_min']:.2f} / "
              f"{long['orchestration_ms_per_turn_min']:.2f} ms (ratio {b['ratio_of_minima']:.3f}); "
              f"target <= 1.1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running SGLang server (default: launch one on CPU)")
    parser.add_argument("--model", help="model directory (tokenizer; served model when launching)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--short-history", type=int, default=1024)
    parser.add_argument("--long-history", type=int, default=32768)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--parts", default="ab", help="which benchmarks to run: a, b or ab")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="megarl-bench-") as workdir:
        engine = None
        if args.url is None:
            engine, args.model = launch(args.model, workdir)
            args.url = engine.url
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
            result = {}
            if "a" in args.parts:
                result["a_throughput"] = asyncio.run(throughput(
                    args.url, tokenizer, args.num_requests, args.new_tokens, args.rounds))
            if "b" in args.parts:
                short, long = (asyncio.run(orchestration(args.url, tokenizer, n, args.turns, args.reps))
                               for n in (args.short_history, args.long_history))
                result["b_orchestration"] = {
                    "short": short, "long": long,
                    "ratio": long["orchestration_ms_per_turn_median"]
                    / short["orchestration_ms_per_turn_median"],
                    "ratio_of_minima": long["orchestration_ms_per_turn_min"]
                    / short["orchestration_ms_per_turn_min"]}
        finally:
            if engine is not None:
                engine.stop()
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
