"""Kimi-K2.5's text backbone on Megatron-Core (CPU, gloo) against transformers: conversion and forward.

The tiny Kimi-K2.5 directory has the release's layout: the DeepSeek-V3 language model under
``language_model.`` (``text_config``), a vision tower and a projector beside it.

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical for every text-backbone tensor
at TP2 x EP2 (expert TP 1) and at PP2 (2 gloo ranks each); the vision tower and the projector are exactly the
tensors the export leaves out (megarl does not train them; the family module says so).

Forward: Megatron's logits equal transformers' ``Kimi_K25ForConditionalGeneration`` on the same
directory (text-only input ids) within 1e-5, fp32, at TP1 and at TP2 x EP2 (expert TP 1) with sequence parallelism.

SGLang (CPU, ``KimiK25ForConditionalGeneration`` wrapping ``DeepseekV3ForCausalLM``; MLA prefill
through megarl's CPU shim) serves the export (HF -> Megatron TP2 x EP2 -> HF): its own
``load_weights`` consumes every exported name and fills every text parameter (the vision tower
and projector are exactly what stays unwritten), and its prompt logprobs and greedy tokens equal
transformers'. The tiny model declares ``language_model_only`` (see ``kimi_k25.tiny_config``: the
multimodal processor needs torchvision, absent on the CPU install).

References: the original safetensors files and config.json, and transformers' own forward pass,
which reads the release's names through its ``kimi_k25`` conversion mapping (not megarl's table).
"""
import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

BATCH, SEQ = 2, 16
LAYOUTS = {"tp2_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
           "pp2": dict(pipeline_model_parallel_size=2)}
TEXT = "language_model."


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_bit_identical(tiny_kimi_k25_dir, layout, tmp_path):
    ckpt = hf_to_megatron(tiny_kimi_k25_dir, tmp_path / "ckpt", timeout_s=240, **LAYOUTS[layout])
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=240)
    ref, out = _load_all(tiny_kimi_k25_dir), _load_all(exported)
    text = sorted(k for k in ref if k.startswith(TEXT))
    assert TEXT + "model.layers.1.mlp.experts.7.down_proj.weight" in text and TEXT + "lm_head.weight" in text
    assert sorted(out) == text  # the vision tower and projector are left out, nothing else
    assert {k.split(".")[0] for k in ref if not k.startswith(TEXT)} == {"vision_tower", "mm_projector"}
    for name in text:
        assert out[name].dtype == ref[name].dtype and torch.equal(out[name], ref[name]), name
    assert json.loads((exported / "config.json").read_text()) == json.loads((tiny_kimi_k25_dir / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp1", "tp2_ep2"])
def test_forward_matches_transformers(tiny_kimi_k25_dir, layout):
    from transformers import Kimi_K25ForConditionalGeneration

    from megarl.testing.family_forward import megatron_logits
    from megarl.testing.multiproc import run_ranks

    vocab = json.loads((tiny_kimi_k25_dir / "config.json").read_text())["text_config"]["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model = Kimi_K25ForConditionalGeneration.from_pretrained(tiny_kimi_k25_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    ranks = run_ranks(megatron_logits, 1 if layout == "tp1" else 2,
                      args=(str(tiny_kimi_k25_dir), tokens, LAYOUTS.get(layout, {})), timeout_s=360)
    for (logits,) in ranks:
        diff = (logits[..., :vocab] - ref).abs().max().item()
        assert diff <= 1e-5, f"{layout}: max |Megatron - transformers| logit diff {diff:.3g}"


# ------------------------------------------------------------------------------------ SGLang
PROBE = "test_families_v3_glm_probe.check_sglang_names"


@pytest.fixture(scope="module")
def kimi_engine(tiny_kimi_k25_dir, tmp_path_factory):
    """One SGLang CPU server on the tiny Kimi-K2.5 exported through Megatron at TP2 x EP2, with the
    name probe loader (``test_families_v3_glm_probe.py``) allowed."""
    from megarl.rollout import cpu_shims
    from megarl.rollout.engine_process import EngineProcess

    work = tmp_path_factory.mktemp("kimi_sglang")
    ckpt = hf_to_megatron(tiny_kimi_k25_dir, work / "ckpt", timeout_s=240, **LAYOUTS["tp2_ep2"])
    exported = megatron_to_hf_dir(ckpt, work / "hf", timeout_s=240)
    pythonpath = cpu_shims.apply_to_env(dict(os.environ))["PYTHONPATH"] + os.pathsep + str(Path(__file__).parent)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "MEGARL_NAME_PROBE_OUT": str(work / "probe.json")}
    engine = EngineProcess(exported, device="cpu", dtype="float32", mem_fraction_static=0.05, max_total_tokens=4096,
                           grammar_backend="none", custom_weight_loaders=[PROBE], env=env,
                           log_path=work / "sglang.log", engine_id="kimi_k25")
    try:
        engine.start().wait_healthy(400)
        yield engine, work
    finally:
        engine.stop(grace_s=0)


async def _generate(engine, input_ids, num_new_tokens):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(engine.url, request_timeout_s=300) as client:
        logprobs = await client.prompt_logprobs(input_ids)
        out = await client._post("/generate", {"input_ids": list(input_ids), "sampling_params": {
            "max_new_tokens": num_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    return logprobs, out["output_ids"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sglang_serves_the_export_like_transformers(kimi_engine):
    from transformers import Kimi_K25ForConditionalGeneration

    engine, _ = kimi_engine
    input_ids = torch.randint(0, 2000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    logprobs, generated = asyncio.run(_generate(engine, input_ids, 4))
    model = Kimi_K25ForConditionalGeneration.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([input_ids])).logits[0], dim=-1)
        greedy = model.generate(input_ids=torch.tensor([input_ids]), max_new_tokens=4, do_sample=False)
    ref_logprobs = ref[:-1].gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]
    diff = (torch.tensor(logprobs) - ref_logprobs).abs().max().item()
    assert diff < 2e-3, f"SGLang vs transformers prompt logprob diff {diff:.3g}"
    assert generated == greedy[0, len(input_ids):].tolist()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sglang_loads_every_exported_name(kimi_engine):
    from megarl.rollout.client import SGLangClient

    engine, work = kimi_engine
    named = sorted(_load_all(engine.model_path).items())

    async def probe():
        async with SGLangClient(engine.url, request_timeout_s=600) as client:
            await client.begin_weight_update()
            await client.update_weights_from_tensor([named], load_format=PROBE, flush_cache=False)
            await client.end_weight_update()

    asyncio.run(probe())
    report = json.loads((work / "probe.json").read_text())
    assert report["ignored"] == [], "exported tensors the engine's load_weights silently ignores"
    text = [p for p in report["engine_params"] if p.startswith("language_model.")]
    assert len(text) > 10
    # every text parameter is written; what stays unwritten is the vision side the export leaves out
    assert report["unfilled_with_all"] == sorted(p for p in report["engine_params"] if not p.startswith("language_model."))
    assert {p.split(".")[0] for p in report["unfilled_with_all"]} == {"vision_tower", "mm_projector"}
