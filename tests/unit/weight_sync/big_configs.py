"""config.json-like metadata of models too large to run here (public architecture numbers)."""

QWEN3_235B_A22B = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
"""Qwen3-235B-A22B (transformers 4.x spelling)."""

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "topk_method": "noaux_tc", "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
"""DeepSeek-V3 (bf16 metadata; the multi-token-prediction layer is left out)."""
