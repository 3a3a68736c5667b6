"""GLM-4.5 (``Glm4MoeForCausalLM``, model_type ``glm4_moe``): GQA with partial rotary, optional
q/k RMSNorm (``use_qk_norm``) and q/k/v biases (``attention_bias``), ``first_k_dense_replace``
dense layers, then MoE layers with shared experts and the DeepSeek-V3 sigmoid router
(``e_score_correction_bias``, group-limited top-k, routed scaling factor; see ``deepseek_v3``).

Rotary: HF rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head with
``rotate_half`` (non-interleaved) and passes the rest through; Megatron's ``rotary_percent`` does
the same. The q/k norms act on whole heads before rope in both. The q/k/v biases fuse into
``linear_qkv.bias`` with the same per-query-group interleaving as the weights.
"""
from __future__ import annotations

from megarl.models.families import Family, rope_settings
from megarl.models.families import qwen3_moe as qwen
from megarl.models.families.deepseek_v3 import (
    SIGMOID_MOE_TABLE,
    moe_layer_shapes,
    note_mtp_layers,
    router_architecture,
    router_config_kwargs,
    tiny_moe_kwargs,
)
from megarl.models.fp8_blocks import parse_quantization_config
from megarl.models.table import Entry, TPSplit, Transform

HF = "model.layers.{L}."
MC = "decoder.layers.{L}."

ATTENTION_TABLE = {
    **qwen.ATTENTION_TABLE,
    MC + "self_attention.linear_qkv.bias": Entry(
        (HF + "self_attn.q_proj.bias", HF + "self_attn.k_proj.bias", HF + "self_attn.v_proj.bias"),
        Transform.QKV, TPSplit.COLUMN),
}

TABLE = {**qwen.GLOBAL_TABLE, **ATTENTION_TABLE, **qwen.DENSE_MLP_TABLE, **SIGMOID_MOE_TABLE}


def _partial_rotary_factor(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    value = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return float(value if value is not None else 0.5)  # transformers' default for glm4_moe


def architecture(hf_config) -> dict:
    """Canonical architecture of a GLM-4.5 HF config.

    A block-FP8 ``quantization_config`` is accepted (dequantised while read, as DeepSeek-V3's).

    Raises:
        ValueError: an unsupported setting, naming the HF field (rope type other than default,
            activation other than SiLU, a quantisation other than block FP8, or a router setting, see
            :func:`~megarl.models.families.deepseek_v3.router_architecture`).
    """
    theta, rope_type = rope_settings(hf_config)
    unsupported = {"rope_type": (rope_type, rope_type != "default"),
                   "hidden_act": (getattr(hf_config, "hidden_act", "silu"),
                                  getattr(hf_config, "hidden_act", "silu") != "silu")}
    for field, (value, bad) in unsupported.items():
        if bad:
            raise ValueError(f"HF config {field}={value!r} is not supported by megarl's glm4_moe mapping")
    parse_quantization_config(getattr(hf_config, "quantization_config", None),
                              where="HF config (glm4_moe) quantization_config")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    arch = dict(
        num_hidden_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_attention_heads=heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab_size=hf_config.vocab_size, rms_norm_eps=hf_config.rms_norm_eps, rope_theta=theta,
        rope_type=rope_type, partial_rotary_factor=_partial_rotary_factor(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        use_qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)))
    arch.update(router_architecture(hf_config, arch["num_hidden_layers"]))
    note_mtp_layers(arch, hf_config)
    return arch


def transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments of GLM-4.5."""
    return dict(
        qwen.common_transformer_config_kwargs(arch), qk_layernorm=arch["use_qk_norm"],
        add_qkv_bias=arch["attention_bias"], **router_config_kwargs(arch))


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments: rope on the first ``partial_rotary_factor`` of each head."""
    return dict(qwen.gpt_model_kwargs(arch), rotary_percent=arch["partial_rotary_factor"])


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
                    p + "self_attention.linear_proj.weight": (h, arch["num_attention_heads"] * hd)})
        if arch["attention_bias"]:
            out[p + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if arch["use_qk_norm"]:
            out.update({p + "self_attention.q_layernorm.weight": (hd,), p + "self_attention.k_layernorm.weight": (hd,)})
        if is_moe:
            out.update(moe_layer_shapes(p, arch))
        else:
            out.update({p + "mlp.linear_fc1.weight": (2 * arch["intermediate_size"], h),
                        p + "mlp.linear_fc2.weight": (h, arch["intermediate_size"])})
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


ENGINE_LOAD_GROUPS: tuple = ()
"""None (``Family.engine_load_groups``): SGLang 0.5.23's ``Glm4MoeForCausalLM.load_weights``
(``sglang/srt/models/glm4_moe.py`` lines 1071-1250) passes every tensor to its parameter's
``weight_loader`` at once: q/k/v and gate/up with their shard id (lines 1090-1096), experts with
shard and expert id; nothing is cached across tensors."""

def tiny_config(spec, common: dict):
    """The ``tiny:glm4_moe`` config and model class (:attr:`Family.tiny_config`): partial rotary 0.5,
    q/k norm, q/k/v bias, sigmoid router with ``e_score_correction_bias``."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    moe, common = tiny_moe_kwargs(spec, common)
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": 0.5}
    return Glm4MoeConfig(head_dim=spec.head_dim, rope_parameters=rope, use_qk_norm=True,  # type: ignore[call-arg]
                         attention_bias=True, n_group=1, topk_group=1, **moe, **common), Glm4MoeForCausalLM


FAMILY = Family(name="glm4_moe", twin_engine_tp2=True,  # engine TP 2 at CPU scale (Family.twin_engine_tp2)
                model_types=("glm4_moe",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=gpt_model_kwargs,
                megatron_shapes=megatron_shapes, engine_load_groups=ENGINE_LOAD_GROUPS,
                # <think>...</think>; <tool_call>name <arg_key>k</arg_key><arg_value>v</arg_value>...
                reasoning_parser="glm45", tool_call_parser="glm45",
                # srt/models/glm4_moe.py builds a ParallelLMHead of its own (never reads tie_word_embeddings)
                engine_class="sglang.srt.models.glm4_moe.Glm4MoeForCausalLM", engine_unties_lm_head=True,
                tiny_config=tiny_config, tiny_random_norms=True, tiny_mtp_layer=True)
