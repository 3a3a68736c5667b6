"""`megarl.plan` memory on paper against independent references.

- Megatron-LM's theoretical memory formula (``megatron/training/theoretical_memory_usage.py``,
  ``compute_weight_and_optimizer_memory``, core_v0.16-era; not shipped in the megatron-core wheel)
  re-derived here from its text: the most loaded shard holds ``(layers / PP + embedding) / TP``
  parameters (``+ output / TP`` untied at PP 1), each costing ``6 + 12 / DP`` bytes with the
  distributed optimizer (BF16 weight, FP32 gradient, FP32 main weight + Adam's two moments
  sharded over DP), ``18`` without. The formula has no expert parallelism, so layouts have EP 1
  (experts split over TP, like the rest); the planner must agree within 5%.
- The weight sync's Megatron parameter specs (``param_specs_from_hf_config``, built from the
  checkpoint family's shape table) for the total parameter count.
- Closed forms for the engine's KV cache per token.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from megarl.plan.memory import EngineSetup, TrainerSetup, engine_memory, trainer_memory
from megarl.plan.shape import ModelShape

MODELS = Path(__file__).resolve().parents[3] / "configs" / "models"
NAMES = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2-like", "glm-4.5"]


def _hf(name):
    return AutoConfig.from_pretrained(MODELS / name)


def _megatron_weight_and_optimizer_bytes(hf, *, tp, pp, dp, distributed_optimizer=True, divisible_by=128):
    """Megatron-LM's ``compute_weight_and_optimizer_memory``, re-derived (module docstring)."""
    h, layers = hf.hidden_size, hf.num_hidden_layers
    heads = hf.num_attention_heads
    experts = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None)
    moe_ffn = hf.moe_intermediate_size
    shared_ffn = (getattr(hf, "n_shared_experts", 0) or 0) * moe_ffn
    first_dense = getattr(hf, "first_k_dense_replace", 0) or 0
    num_moe, num_dense = layers - first_dense, first_dense
    norm = 1  # RMSNorm
    if getattr(hf, "kv_lora_rank", None):  # multi-latent attention
        qk, rope, v = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        q_term = hf.q_lora_rank * (h + heads * (qk + rope) + norm)
        attn = q_term + hf.kv_lora_rank * (h + heads * (qk + v) + norm) + h * rope + heads * v * h
    else:
        q_size = hf.head_dim * heads
        attn = 2 * h * h * (1 + hf.num_key_value_heads / heads) * (q_size / h)
    dense_layer = 2 * h * (hf.intermediate_size * 1.5 + norm) + attn
    moe_layer = 2 * h * (moe_ffn * experts * 1.5 + shared_ffn * 1.5 + norm) + attn
    unit = divisible_by * tp
    vocab = -(-hf.vocab_size // unit) * unit
    embedding = h * vocab
    block = dense_layer * num_dense + moe_layer * num_moe + norm * h
    shard = (block / pp + embedding) / tp
    if not hf.tie_word_embeddings and pp == 1:
        shard += embedding / tp
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    return shard * per_param


LAYOUTS = [(1, 1, 8), (2, 1, 4), (4, 2, 8), (8, 4, 2), (2, 8, 16)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp, pp, dp", LAYOUTS)
def test_weights_and_optimizer_agree_with_megatron_formula(name, tp, pp, dp):
    hf = _hf(name)
    if hf.num_hidden_layers % pp:
        pytest.skip("the formula assumes an even split of the layers")
    setup = TrainerSetup(world_size=tp * pp * dp, tp=tp, pp=pp, ep=1, etp=tp, sequence_parallel=tp > 1)
    memory = trainer_memory(ModelShape.from_hf_config(hf), setup)
    ours = sum(memory.consumers[k] for k in ("weights", "gradients", "main_weights", "adam_states"))
    reference = _megatron_weight_and_optimizer_bytes(hf, tp=tp, pp=pp, dp=dp)
    assert abs(ours / reference - 1) < 0.05, (name, tp, pp, dp, ours / 1e9, reference / 1e9)


@pytest.mark.timeout(60)
def test_without_distributed_optimizer_every_rank_holds_18_bytes_per_parameter():
    hf = _hf("qwen3-235b-a22b")
    setup = TrainerSetup(world_size=64, tp=4, pp=4, ep=1, etp=4, sequence_parallel=True, distributed_optimizer=False)
    memory = trainer_memory(ModelShape.from_hf_config(hf), setup)
    ours = sum(memory.consumers[k] for k in ("weights", "gradients", "main_weights", "adam_states"))
    reference = _megatron_weight_and_optimizer_bytes(hf, tp=4, pp=4, dp=4, distributed_optimizer=False)
    assert abs(ours / reference - 1) < 0.05


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_total_parameters_match_the_weight_sync_specs(name):
    from megarl.weight_sync.model_specs import param_specs_from_hf_config

    hf = _hf(name)
    specs = param_specs_from_hf_config(hf, tensor_model_parallel_size=1, make_vocab_size_divisible_by=128,
                                       dtype="bfloat16")
    reference = 0
    for spec in specs:
        n = 1
        for d in spec.shape:
            n *= d
        reference += n
    assert abs(ModelShape.from_hf_config(hf).total_params() / reference - 1) < 0.005


@pytest.mark.timeout(60)
def test_expert_parameters_shard_over_ep_and_their_optimizer_over_expert_dp():
    """Doubling EP halves the experts' weights and gradients on a rank; Adam states of experts are
    divided by expert-DP = world / (EP x ETP x PP), so at a fixed world size they stay the same."""
    shape = ModelShape.from_hf_config(_hf("qwen3-30b-a3b"))
    experts = sum(shape.moe_params()[0] for _ in shape.moe_layers if _)
    a = trainer_memory(shape, TrainerSetup(world_size=16, tp=1, ep=4, etp=1))
    b = trainer_memory(shape, TrainerSetup(world_size=16, tp=1, ep=8, etp=1))
    assert a.consumers["weights"] - b.consumers["weights"] == pytest.approx(experts * 2 * (1 / 4 - 1 / 8), rel=1e-6)
    assert a.consumers["adam_states"] == pytest.approx(b.consumers["adam_states"], rel=1e-6)


@pytest.mark.timeout(60)
def test_recompute_full_keeps_less_than_selective_and_none():
    shape = ModelShape.from_hf_config(_hf("qwen3-235b-a22b"))
    acts = {r: trainer_memory(shape, TrainerSetup(world_size=64, tp=4, pp=4, ep=4, etp=1, sequence_parallel=True,
                                                  recompute=r, tokens_per_microbatch=8192)).consumers["activations"]
            for r in (None, "selective", "full")}
    assert acts["full"] < acts["selective"] <= acts[None]
    # full: each layer keeps its BF16 input (2 h bytes per token / TP), PP micro batches in flight on stage 0
    stage_layers = shape.num_layers // 4
    assert acts["full"] > 8192 / 4 * 2 * shape.hidden_size * stage_layers * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, tp, expected", [
    # MLA: (kv_lora_rank + qk_rope_head_dim) x layers x 2 B on every engine rank
    ("deepseek-v3", 8, (512 + 64) * 61 * 2),
    ("kimi-k2-like", 8, (512 + 64) * 61 * 2),
    # GQA: 2 (K and V) x max(1, kv_heads / TP) x head_dim x layers x 2 B
    ("qwen3-30b-a3b", 4, 2 * 1 * 128 * 48 * 2),
    ("qwen3-235b-a22b", 8, 2 * 1 * 128 * 94 * 2),
    ("glm-4.5", 2, 2 * 4 * 128 * 92 * 2),
])
def test_kv_cache_per_token(name, tp, expected):
    mem = engine_memory(ModelShape.from_hf_config(_hf(name)), EngineSetup(tp=tp), int(80e9))
    assert mem.kv_per_token == expected
    assert mem.tokens_fit == max(int(0.8 * 80e9) - mem.weights, 0) // expected


@pytest.mark.timeout(60)
def test_engine_weights_bf16_and_block_fp8():
    """BF16: every parameter at 2 B over the engine's GPUs (replicated pieces aside); block FP8 about half."""
    shape = ModelShape.from_hf_config(_hf("deepseek-v3"))
    bf16 = engine_memory(shape, EngineSetup(tp=8), int(80e9))
    fp8 = engine_memory(shape, EngineSetup(tp=8, fp8=True), int(80e9))
    assert abs(bf16.weights * 8 / (shape.total_params() * 2) - 1) < 0.02
    assert bf16.tokens_fit == 0, "DeepSeek-V3 in BF16 does not fit one 8 x H100 engine (169.6 GB per GPU)"
    assert 0.5 < fp8.weights / bf16.weights < 0.53
    assert fp8.tokens_fit == 0, "block FP8 still needs 85 GB per GPU of one 8-GPU engine: not an H100"
    h200 = engine_memory(shape, EngineSetup(tp=8, fp8=True), int(141e9))
    assert h200.tokens_fit == (int(0.8 * 141e9) - h200.weights) // ((512 + 64) * 61 * 2) > 100_000
