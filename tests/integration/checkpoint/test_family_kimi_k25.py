"""Kimi-K2.5's text backbone on Megatron-Core (CPU, gloo) against transformers: conversion and forward.

The tiny Kimi-K2.5 directory has the release's layout: the DeepSeek-V3 language model under
``language_model.`` (``text_config``), a vision tower and a projector beside it.

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical for every text-backbone tensor
at TP2 x EP2 (expert TP 1) and at PP2 (2 gloo ranks each); the vision tower and the projector are exactly the
tensors the export leaves out (megarl does not train them; the family module says so).

Forward: Megatron's logits equal transformers' ``Kimi_K25ForConditionalGeneration`` on the same
directory (text-only input ids) within 1e-5, fp32, at TP1 and at TP2 x EP2 (expert TP 1) with sequence parallelism.

References: the original safetensors files and config.json, and transformers' own forward pass,
which reads the release's names through its ``kimi_k25`` conversion mapping (not megarl's table).
"""
import json

import pytest
import torch

from megarl.checkpoint.convert import hf_to_megatron, megatron_to_hf_dir
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


def _forward_worker(rank, world_size, hf_dir, tokens, layout):
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from megarl.checkpoint import load_hf_weights
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    parallel = ParallelConfig(**LAYOUTS.get(layout, {}), sequence_parallel=layout != "tp1")
    state = initialize_parallel(parallel, backend="gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    chunks[0].eval()
    with torch.no_grad():
        logits = chunks[0](tokens, torch.arange(SEQ).expand_as(tokens), None)
    if state.tp_size > 1:
        shards = [torch.empty_like(logits) for _ in range(state.tp_size)]
        dist.all_gather(shards, logits.contiguous(), group=mps.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    return logits


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp1", "tp2_ep2"])
def test_forward_matches_transformers(tiny_kimi_k25_dir, layout):
    from transformers import Kimi_K25ForConditionalGeneration

    from megarl.testing.multiproc import run_ranks

    vocab = json.loads((tiny_kimi_k25_dir / "config.json").read_text())["text_config"]["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model = Kimi_K25ForConditionalGeneration.from_pretrained(tiny_kimi_k25_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    ranks = run_ranks(_forward_worker, 1 if layout == "tp1" else 2, args=(str(tiny_kimi_k25_dir), tokens, layout),
                      timeout_s=360)
    for logits in ranks:
        diff = (logits[..., :vocab] - ref).abs().max().item()
        assert diff <= 1e-5, f"{layout}: max |Megatron - transformers| logit diff {diff:.3g}"
