"""SGLang's gpt-oss model on the CPU server: prefill, decode and a cached second turn equal transformers.

Without ``megarl/rollout/cpu_shims/sglang_sink_attention.py`` SGLang 0.5.23 refuses ``torch_native``
for ``GptOssForCausalLM`` at start-up (``arg_groups/model_hook.py``), and its torch-native backend has
no attention sinks. The tiny model's sliding window (4) is much shorter than the sequences here, its
second layer attends over everything, and its experts carry biases and the clamped SwiGLU, so every
gpt-oss piece is on the path. Reference: transformers' eager forward of the same weights (float32).
"""
from __future__ import annotations

import pytest

from megarl.testing.engine_logprobs import all_logprobs, generate, max_gap, teacher_forced_logprobs

PROMPT = [5, 17, 230, 41, 9, 88, 301, 12, 64, 7, 150, 3, 99, 271, 18, 42]
OTHER = [8, 1200, 33, 14, 600, 2, 77, 5, 19]
NEW_TOKENS = 8
TOL = 2e-3
"""float32 on both sides, as the other families' serving tests (``test_engine_mla_cpu.py``); SGLang
keeps the sinks in bfloat16 (the shim's docstring), which moves logprobs by far less than this."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_gpt_oss_engine_matches_transformers(tiny_gpt_oss_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.rollout.engine_process import EngineProcess

    engine = EngineProcess(tiny_gpt_oss_dir, device="cpu", dtype="float32", mem_fraction_static=0.05,
                           max_total_tokens=2048, grammar_backend="none", log_path=tmp_path / "engine.log",
                           env={"OMP_NUM_THREADS": "1"})
    with engine.start():
        engine.wait_healthy(timeout_s=600)
        first = generate(engine.url, PROMPT, NEW_TOKENS, 0)
        out_ids, got_first = all_logprobs(first)
        # A second turn on the cached prefix: prefill over a radix-cache hit, then decode.
        turn2 = PROMPT + out_ids + [11, 12, 13]
        second = generate(engine.url, turn2, 4, -1)
        # Two requests of different lengths in one batch (one prefill over both, then batched decode).
        batch = generate(engine.url, [OTHER, PROMPT[:11]], NEW_TOKENS, 0)
    assert len(out_ids) == NEW_TOKENS
    assert second["cached_tokens"] > 0, "the second turn did not reuse the cached prefix"

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    second_out = [t for _, t, _ in second["output_token_logprobs"]]
    ref_second = teacher_forced_logprobs(model, turn2 + second_out)
    gaps = {"first turn (prefill + decode)": max_gap(got_first, ref_second[:len(got_first)]),
            "second turn (cached prefix + decode)": max_gap([lp for lp, _, _ in second["output_token_logprobs"]],
                                                         ref_second[-4:])}
    for prompt, meta in zip([OTHER, PROMPT[:11]], batch):
        ids, got = all_logprobs(meta)
        gaps[f"batched request of {len(prompt)} tokens"] = max_gap(got, teacher_forced_logprobs(model, prompt + ids))
    print("engine vs transformers, max |logprob gap|:", gaps)
    assert max(gaps.values()) < TOL, f"engine vs transformers logprob gaps: {gaps}"


RESOLVE = ("import sys\n"
           "from sglang.srt.server_args import ServerArgs\n"
           "args = ServerArgs(model_path=sys.argv[1], device='cpu', attention_backend='torch_native',\n"
           "                  sampling_backend='pytorch', grammar_backend='none')\n"
           "args.resolve_once()\n"
           "print('RESOLVED', args.attention_backend)\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sglang_still_refuses_torch_native_for_gpt_oss_without_the_shim(tiny_gpt_oss_dir, tmp_path):
    # SGLang's server-argument resolution, as the server runs it, with every CPU shim and with every
    # shim but sglang_sink_attention. If the second case passes, SGLang accepts torch_native for
    # gpt-oss itself: re-check whether its backend has sinks now and delete the shim.
    import os
    import subprocess
    import sys

    from megarl.rollout import cpu_shims

    without = tmp_path / "shims_without_sink_attention"
    without.mkdir()
    for entry in cpu_shims.shim_dir().iterdir():
        if entry.name.removesuffix(".py") in set(cpu_shims.SHIM_NAMES) - {"sglang_sink_attention"}:
            (without / entry.name).symlink_to(entry)
    procs = {name: subprocess.Popen(
        [sys.executable, "-c", RESOLVE, str(tiny_gpt_oss_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, PYTHONPATH=str(shims), SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1"))
        for name, shims in (("all", cpu_shims.shim_dir()), ("without", without))}
    try:
        out = {name: p.communicate(timeout=540)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs["all"].returncode == 0 and "RESOLVED torch_native" in out["all"], out["all"][-3000:]
    assert procs["without"].returncode != 0, "SGLang accepted torch_native for gpt-oss without the shim"
    assert "GptOssForCausalLM requires one of" in out["without"], out["without"][-3000:]
