"""DeepSeek-V3.2 (DeepSeek Sparse Attention) on Megatron-Core (CPU, gloo) against transformers.

Forward: Megatron's logits (the local spec: Megatron's ``MLASelfAttention`` with megarl's
``LocalDSAttention`` / ``LocalDSAIndexer``, subclasses of Megatron's ``DSAttention`` / ``DSAIndexer``)
equal transformers' ``DeepseekV32ForCausalLM`` logits of the same HF directory within 1e-5, fp32, at
TP1 and at TP2 x EP2 with sequence parallelism (expert TP 1), with one sequence per row and with the
two sequences packed in one row (each must score and attend to its own keys only). The sequences
(24 tokens) are longer than the indexer's top 8, and transformers' own logits change by more than
1e-3 when every key is kept (checked here), so a wrong indexer conversion (its per-head rope
permutation, the key norm) or a leak across packed sequences cannot pass.

Gradients (slow): in training mode, the MoE layer's MLA gradients through the sparse attention
equal transformers' within 1e-5 of their scale at TP1, and the frozen indexer gets none.

Conversion: HF -> Megatron dist checkpoint -> HF is bit-identical at TP1 and at TP2 x EP2 (expert
TP 1): the indexer's ``wq_b`` / ``wk`` / ``k_norm`` rows go through their per-head permutation and
back, and the random key-norm bias differs from a fresh one. Reference: the original safetensors
files and config.json.
"""
import json

import pytest
import torch

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

BATCH, SEQ = 2, 24
LAYOUTS = {"tp1": {},
           "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_bit_identical(tiny_deepseek_v32_dir, layout, tmp_path):
    ckpt = hf_to_megatron(tiny_deepseek_v32_dir, tmp_path / "ckpt", timeout_s=280, **LAYOUTS[layout])
    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=280)
    ref, out = _load_all(tiny_deepseek_v32_dir), _load_all(exported)
    assert {"model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.0.self_attn.indexer.k_norm.bias"} <= set(ref)
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    config = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == config


def _tokens(config):
    return torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def test_sparse_selection_changes_transformers_logits(tiny_deepseek_v32_dir):
    """The indexer matters on the test's sequences: keeping every key instead of the top 8 moves
    transformers' logits by more than 1e-3 (so the forward comparison below checks the indexer)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    assert config["index_topk"] < SEQ
    sparse = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v32_dir, dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v32_dir, dtype=torch.float32, index_topk=SEQ).eval()
    with torch.no_grad():
        diff = (sparse(_tokens(config)).logits - dense(_tokens(config)).logits).abs().max().item()
    assert diff > 1e-3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_transformers(tiny_deepseek_v32_dir, layout):
    from transformers import AutoModelForCausalLM

    from megarl.testing.family_forward import megatron_logits
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    tokens = _tokens(config)
    model = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v32_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    ranks = run_ranks(megatron_logits, 1 if layout == "tp1" else 2,
                      args=(str(tiny_deepseek_v32_dir), tokens, LAYOUTS[layout], True), timeout_s=500)
    for rank in ranks:
        for logits, what in zip(rank, ("batched", "packed")):
            diff = (logits[..., :config["vocab_size"]] - ref).abs().max().item()
            assert diff <= 1e-5, f"{layout}, {what}: max |Megatron - transformers| logit diff {diff:.3g}"


def _grad_worker(rank, world_size, hf_dir, tokens, vocab):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    state = initialize_parallel(ParallelConfig(), backend="gloo")
    chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    logits = chunks[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    logits[..., :vocab].logsumexp(-1).mean().backward()
    out = {}
    for name, p in chunks[0].decoder.layers[1].self_attention.named_parameters():
        grad = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        out[name] = (p.requires_grad, None if grad is None else grad.clone())
    return out


@pytest.mark.slow  # ~60 s of rank start-up and backward on a loaded 2-core machine
@pytest.mark.timeout(300)
def test_sparse_attention_gradients_match_transformers(tiny_deepseek_v32_dir):
    """Training mode: the MoE layer's MLA gradients through the sparse attention (a logsumexp loss
    over 24 tokens, top 8 keys) equal transformers' gradients of the same HF tensors within 1e-5 of
    their scale, at TP1; the indexer is frozen (no gradient; transformers' runs under no_grad)."""
    from transformers import AutoModelForCausalLM

    from megarl.models.families import get_family
    from megarl.models.mapping import lookup, to_hf
    from megarl.testing.multiproc import run_ranks

    config = json.loads((tiny_deepseek_v32_dir / "config.json").read_text())
    tokens = _tokens(config)
    model = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v32_dir, dtype=torch.float32)
    model(tokens).logits.logsumexp(-1).mean().backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    grads = run_ranks(_grad_worker, 1, args=(str(tiny_deepseek_v32_dir), tokens, config["vocab_size"]),
                      timeout_s=240)[0]
    family = get_family("deepseek_v32")
    layout = family.layout(model.config)
    checked = 0
    for name, (trainable, grad) in grads.items():
        if ".indexer." in name:
            assert not trainable and grad is None, name
            continue
        entry, values = lookup(family.table, f"decoder.layers.1.self_attention.{name}")
        for hf_name, ours in zip([t.format(**values) for t in entry.hf], to_hf(entry, grad, layout)):
            ref = hf_grads[hf_name]
            assert ref.abs().max() > 0, hf_name
            assert (ours - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), hf_name
            checked += 1
    assert checked == 7  # q down/up, q norm, kv down/up, kv norm, output projection
