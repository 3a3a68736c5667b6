"""`megarl plan` counts the engine's lm_head of a tied Qwen3-MoE / GLM-4.5 checkpoint (SGLang keeps it apart
and the engine serves an untied view), and only one vocabulary copy where SGLang shares it (dense Qwen3).
Each family's rule is checked against SGLang's own class in tests/unit/models/test_family_rules.py."""
from transformers import AutoConfig

from megarl.plan.memory import EngineSetup, engine_memory
from megarl.plan.shape import ModelShape

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 4096, "torch_dtype": "float32"}
MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def test_engine_weights_of_a_tied_checkpoint():
    def weights(model_type: str, tied: bool) -> int:
        extra = MOE if model_type == "qwen3_moe" else {}
        hf = AutoConfig.for_model(model_type=model_type, tie_word_embeddings=tied, **BASE, **extra)
        return engine_memory(ModelShape.from_hf_config(hf), EngineSetup(tp=1), 80 << 30).weights

    vocab_bytes = 4096 * 64 * 2
    assert weights("qwen3_moe", True) == weights("qwen3_moe", False)
    assert weights("qwen3", False) - weights("qwen3", True) == vocab_bytes
