"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with q/k RMSNorm, RoPE, SwiGLU experts, top-k softmax
router without shared expert. Also the attention/norm rows reused by the dense Qwen3 family.

Router semantics: HF computes ``softmax(logits)`` over all experts, takes the top-k, and
renormalises the k weights when ``norm_topk_prob``. That equals Megatron's
``moe_router_pre_softmax=False`` (top-k of the logits, softmax over the k) when ``norm_topk_prob``
is true, and ``moe_router_pre_softmax=True`` (softmax, then top-k) when it is false.
"""
from __future__ import annotations

import torch.nn.functional as F

from megarl.models.families import Family, hf_get, rope_settings
from megarl.models.table import Entry, TPSplit, Transform

C, G, Q, V = Transform.COPY, Transform.GLU, Transform.QKV, Transform.VOCAB
HF = "model.layers.{L}."
MC = "decoder.layers.{L}."

GLOBAL_TABLE = {
    "embedding.word_embeddings.weight": Entry(("model.embed_tokens.weight",), V, TPSplit.COLUMN),
    "decoder.final_layernorm.weight": Entry(("model.norm.weight",), C, TPSplit.NONE),
    "output_layer.weight": Entry(("lm_head.weight",), V, TPSplit.COLUMN),
}

ATTENTION_TABLE = {
    MC + "input_layernorm.weight": Entry((HF + "input_layernorm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_qkv.weight": Entry(
        (HF + "self_attn.q_proj.weight", HF + "self_attn.k_proj.weight", HF + "self_attn.v_proj.weight"),
        Q, TPSplit.COLUMN),
    MC + "self_attention.q_layernorm.weight": Entry((HF + "self_attn.q_norm.weight",), C, TPSplit.NONE),
    MC + "self_attention.k_layernorm.weight": Entry((HF + "self_attn.k_norm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_proj.weight": Entry((HF + "self_attn.o_proj.weight",), C, TPSplit.ROW),
    MC + "pre_mlp_layernorm.weight": Entry((HF + "post_attention_layernorm.weight",), C, TPSplit.NONE),
}

DENSE_MLP_TABLE = {
    MC + "mlp.linear_fc1.weight": Entry((HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"), G, TPSplit.GLU),
    MC + "mlp.linear_fc2.weight": Entry((HF + "mlp.down_proj.weight",), C, TPSplit.ROW),
}

EXPERT = HF + "mlp.experts.{E}."
MOE_TABLE = {
    MC + "mlp.router.weight": Entry((HF + "mlp.gate.weight",), C, TPSplit.NONE),
    # Canonical names (megarl.models.naming): TEGroupedMLP's linear_fc1.weight{E} maps here.
    MC + "mlp.experts.local_experts.{E}.linear_fc1.weight": Entry(
        (EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"), G, TPSplit.GLU, expert=True),
    MC + "mlp.experts.local_experts.{E}.linear_fc2.weight": Entry(
        (EXPERT + "down_proj.weight",), C, TPSplit.ROW, expert=True),
}

TABLE = {**GLOBAL_TABLE, **ATTENTION_TABLE, **DENSE_MLP_TABLE, **MOE_TABLE}
"""Canonical (local-spec) names only; Transformer Engine names are looked up through
``megarl.models.mapping.canonical_name`` (fused norms, grouped-GEMM experts)."""


def check_supported(hf_config) -> None:
    """Reject HF settings this family does not implement.

    Raises:
        ValueError: names the HF config field and its value.
    """
    unsupported = {
        "attention_bias": bool(getattr(hf_config, "attention_bias", False)),
        "use_sliding_window": bool(getattr(hf_config, "use_sliding_window", False)),
        "hidden_act": getattr(hf_config, "hidden_act", "silu") != "silu",
        "rope_type": rope_settings(hf_config)[1] != "default",
    }
    for field, bad in unsupported.items():
        if bad:
            value = rope_settings(hf_config)[1] if field == "rope_type" else getattr(hf_config, field)
            raise ValueError(f"HF config {field}={value!r} is not supported by megarl's "
                             f"{hf_config.model_type} mapping")


def common_architecture(hf_config) -> dict:
    """Architecture fields shared by Qwen3 dense and Qwen3-MoE."""
    check_supported(hf_config)
    theta, rope_type = rope_settings(hf_config)
    heads = hf_config.num_attention_heads
    return {
        "num_hidden_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": hf_get(hf_config, "num_key_value_heads", default=heads),
        "head_dim": hf_get(hf_config, "head_dim", default=hf_config.hidden_size // heads),
        "vocab_size": hf_config.vocab_size,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "rope_theta": theta,
        "rope_type": rope_type,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "initializer_range": getattr(hf_config, "initializer_range", 0.02),
    }


def architecture(hf_config) -> dict:
    """Canonical architecture of a Qwen3-MoE HF config (``num_experts``/``num_local_experts``)."""
    arch = common_architecture(hf_config)
    num_experts = hf_get(hf_config, "num_experts", "num_local_experts")
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    arch.update(
        num_experts=num_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        moe_layers=[i not in dense_only and num_experts > 0 and (i + 1) % step == 0
                    for i in range(arch["num_hidden_layers"])],
    )
    if arch["num_experts_per_tok"] == 1 and arch["norm_topk_prob"]:
        raise ValueError("HF config num_experts_per_tok=1 with norm_topk_prob=True (weight 1) is not "
                         "expressible with Megatron's router (it requires pre-softmax for top-1)")
    return arch


def common_transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments shared by the Qwen3 families."""
    return dict(
        num_layers=arch["num_hidden_layers"], hidden_size=arch["hidden_size"],
        ffn_hidden_size=arch["intermediate_size"], num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_key_value_heads"], kv_channels=arch["head_dim"],
        normalization="RMSNorm", layernorm_epsilon=arch["rms_norm_eps"], qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        init_method_std=arch["initializer_range"])


def transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments of Qwen3-MoE."""
    return dict(
        common_transformer_config_kwargs(arch),
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_intermediate_size"],
        moe_router_topk=arch["num_experts_per_tok"], moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch["norm_topk_prob"],
        moe_layer_freq=[int(m) for m in arch["moe_layers"]], moe_shared_expert_intermediate_size=None)


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments (RoPE, tied embeddings, max length)."""
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch["rope_theta"],
                share_embeddings_and_output_weights=arch["tie_word_embeddings"],
                max_sequence_length=arch["max_position_embeddings"])


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Full Megatron shapes (global local-spec names, unpadded vocabulary) of every parameter."""
    h, hd = arch["hidden_size"], arch["head_dim"]
    qkv_rows = (arch["num_attention_heads"] + 2 * arch["num_key_value_heads"]) * hd
    out = {"embedding.word_embeddings.weight": (arch["vocab_size"], h),
           "decoder.final_layernorm.weight": (h,), "output_layer.weight": (arch["vocab_size"], h)}
    for i, is_moe in enumerate(arch["moe_layers"]):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                    p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                    p + "self_attention.q_layernorm.weight": (hd,),
                    p + "self_attention.k_layernorm.weight": (hd,),
                    p + "self_attention.linear_proj.weight": (h, arch["num_attention_heads"] * hd)})
        if is_moe:
            f = arch["moe_intermediate_size"]
            out[p + "mlp.router.weight"] = (arch["num_experts"], h)
            for e in range(arch["num_experts"]):
                out[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
                out[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        else:
            f = arch["intermediate_size"]
            out[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            out[p + "mlp.linear_fc2.weight"] = (h, f)
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


ENGINE_LOAD_GROUPS: tuple = ()
"""None (``Family.engine_load_groups``), for Qwen3-MoE and Qwen3: SGLang 0.5.23's
``Qwen3MoeForCausalLM.load_weights`` (``sglang/srt/models/qwen3_moe.py`` lines 1157-1167) and
``Qwen3ForCausalLM.load_weights`` (``qwen3.py`` lines 686-692) load every tensor through its own
``weight_loader`` call: q/k/v and gate/up with a shard id, experts with shard and expert id."""

def tiny_config(spec, common: dict):
    """The ``tiny:qwen3_moe`` config (every layer MoE) and model class (:attr:`Family.tiny_config`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], **common)
    return cfg, Qwen3MoeForCausalLM


FAMILY = Family(name="qwen3_moe", twin_engine_tp2=True,  # engine TP 2 at CPU scale (Family.twin_engine_tp2)
                model_types=("qwen3_moe",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=gpt_model_kwargs,
                megatron_shapes=megatron_shapes, engine_load_groups=ENGINE_LOAD_GROUPS,
                # <think>...</think>; <tool_call>{json}</tool_call>
                reasoning_parser="qwen3", tool_call_parser="qwen25",
                # srt/models/qwen3_moe.py builds a ParallelLMHead of its own (never reads tie_word_embeddings)
                engine_class="sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM", engine_unties_lm_head=True,
                tiny_config=tiny_config)
