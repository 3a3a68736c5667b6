"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``): multi-latent attention,
``first_k_dense_replace`` dense layers then MoE layers with shared experts and a sigmoid router
with expert-bias correction, group-limited top-k and a routed scaling factor.

Also the sigmoid-router MoE pieces reused by GLM-4.5 (``glm4_moe``), whose router is the same.

MLA. Megatron's ``MLASelfAttention`` keeps the HF projections whole, in HF row order
(``q_b_proj`` rows per head ``[nope; rope]``, ``kv_b_proj`` rows per head ``[k_nope; v]``,
``kv_a_proj_with_mqa`` rows ``[kv_latent; k_rope]``), so every MLA entry is a plain copy. HF
``rope_interleave=True`` rotates the pairs ``(x0, x1), (x2, x3), ...``; Megatron's MLA rope
de-interleaves the rope dims (``x[0::2] ++ x[1::2]``) and rotates halves, which is the same
function; ``rope_interleave=False`` is rejected. YaRN: HF ``attention_factor`` =
``mscale(f, mscale) / mscale(f, mscale_all_dim)`` on cos/sin and softmax scale x
``mscale(f, mscale_all_dim)^2`` are Megatron's ``YarnRotaryEmbedding`` concentration factor and
``MultiLatentAttention.softmax_scale``.

Router (HF ``DeepseekV3TopkRouter``; Megatron ``topk_routing_with_score_function``):
``s = sigmoid(h W^T)`` (fp32), choose the experts by ``s + e_score_correction_bias`` (first the
``topk_group`` of ``n_group`` groups by the sum of each group's top-2, then top-k inside them),
weights ``s_i / sum_k s_k * routed_scaling_factor``. Megatron ranks groups by the sum of the
top-``(topk / group_topk)``, so group-limited routing is exact only when ``topk / topk_group = 2``
(DeepSeek-V3: 8 / 4); other values are rejected. Megatron always renormalises the k sigmoid
weights (k > 1), so ``norm_topk_prob=False`` and top-1 are rejected. Megatron's ``expert_bias``
buffer holds ``e_score_correction_bias``; ``moe_router_bias_update_rate=0`` keeps it fixed during
RL (the rollout engine keeps routing with the checkpoint's bias; slime does the same).

Multi-token-prediction layers (``num_nextn_predict_layers``, HF ``model.layers.{L >= num_hidden_layers}``)
are not built: they are dropped on import (logged once) and absent from exports.
"""
from __future__ import annotations

import logging

import torch.nn.functional as F

from megarl.models.families import Family, ParserVariant, hf_get, rope_settings
from megarl.models.families.qwen3_moe import DENSE_MLP_TABLE, GLOBAL_TABLE, MOE_TABLE
from megarl.models.table import Entry, TPSplit, Transform

logger = logging.getLogger(__name__)

C, G = Transform.COPY, Transform.GLU
HF = "model.layers.{L}."
MC = "decoder.layers.{L}."
ATTN = HF + "self_attn."

SIGMOID_MOE_TABLE = {
    **MOE_TABLE,
    # Megatron's TopKRouter.expert_bias (a buffer; build_model makes it a frozen parameter).
    MC + "mlp.router.expert_bias": Entry((HF + "mlp.gate.e_score_correction_bias",), C, TPSplit.NONE),
    MC + "mlp.shared_experts.linear_fc1.weight": Entry(
        (HF + "mlp.shared_experts.gate_proj.weight", HF + "mlp.shared_experts.up_proj.weight"), G, TPSplit.GLU),
    MC + "mlp.shared_experts.linear_fc2.weight": Entry((HF + "mlp.shared_experts.down_proj.weight",), C, TPSplit.ROW),
}
"""Sigmoid-router MoE layer with shared experts (DeepSeek-V3, GLM-4.5)."""

MLA_TABLE = {
    MC + "input_layernorm.weight": Entry((HF + "input_layernorm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_q_proj.weight": Entry((ATTN + "q_proj.weight",), C, TPSplit.COLUMN),
    # Local spec: the down projections are ColumnParallelLinear (rows split over TP, gathered in
    # forward). The Transformer Engine spec replicates them (TELinear "duplicated"): the loader
    # sees that (ParamInfo.tp_split) and weight sync gets their TP shard (params.iter_sync_params).
    MC + "self_attention.linear_q_down_proj.weight": Entry((ATTN + "q_a_proj.weight",), C, TPSplit.COLUMN),
    MC + "self_attention.q_layernorm.weight": Entry((ATTN + "q_a_layernorm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_q_up_proj.weight": Entry((ATTN + "q_b_proj.weight",), C, TPSplit.COLUMN),
    MC + "self_attention.linear_kv_down_proj.weight": Entry((ATTN + "kv_a_proj_with_mqa.weight",), C, TPSplit.COLUMN),
    MC + "self_attention.kv_layernorm.weight": Entry((ATTN + "kv_a_layernorm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_kv_up_proj.weight": Entry((ATTN + "kv_b_proj.weight",), C, TPSplit.COLUMN),
    MC + "self_attention.linear_proj.weight": Entry((ATTN + "o_proj.weight",), C, TPSplit.ROW),
    MC + "pre_mlp_layernorm.weight": Entry((HF + "post_attention_layernorm.weight",), C, TPSplit.NONE),
}

TABLE = {**GLOBAL_TABLE, **MLA_TABLE, **DENSE_MLP_TABLE, **SIGMOID_MOE_TABLE}

_NOTED_MTP: set = set()


def _reject(hf_config, field: str, value, why: str) -> None:
    raise ValueError(f"HF config {field}={value!r} is not supported by megarl's {hf_config.model_type} "
                     f"mapping: {why}")


def router_architecture(hf_config, num_layers: int) -> dict:
    """Sigmoid-router MoE fields (DeepSeek-V3 / GLM-4.5 spelling) of an HF config.

    Raises:
        ValueError: a router setting Megatron cannot reproduce (names the HF field).
    """
    num_experts = hf_get(hf_config, "n_routed_experts", "num_local_experts", "num_experts")
    topk = hf_config.num_experts_per_tok
    n_group = getattr(hf_config, "n_group", None) or 1
    topk_group = getattr(hf_config, "topk_group", None) or n_group
    scoring = getattr(hf_config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        _reject(hf_config, "scoring_func", scoring, "the router must be sigmoid")
    if getattr(hf_config, "topk_method", "noaux_tc") != "noaux_tc":
        _reject(hf_config, "topk_method", hf_config.topk_method, "only noaux_tc (bias-corrected) routing")
    if not getattr(hf_config, "norm_topk_prob", True):
        _reject(hf_config, "norm_topk_prob", False, "Megatron always renormalises the sigmoid top-k weights")
    if topk < 2:
        _reject(hf_config, "num_experts_per_tok", topk, "Megatron does not renormalise a top-1 sigmoid weight")
    grouped = n_group > 1 and topk_group < n_group
    if grouped and topk // topk_group != 2:
        _reject(hf_config, "topk_group", topk_group, f"Megatron ranks groups by their top-(num_experts_per_tok "
                f"/ topk_group) = top-{topk // topk_group} scores, HF by their top-2")
    shared = getattr(hf_config, "n_shared_experts", None) or 0
    if shared < 1:
        _reject(hf_config, "n_shared_experts", shared, "at least one shared expert is expected")
    first_dense = getattr(hf_config, "first_k_dense_replace", None) or 0
    if (getattr(hf_config, "moe_layer_freq", None) or 1) != 1:  # transformers ignores it, SGLang does not
        _reject(hf_config, "moe_layer_freq", hf_config.moe_layer_freq, "every layer after the dense ones is MoE")
    return dict(
        num_experts=num_experts, num_experts_per_tok=topk, moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=True, n_shared_experts=shared, routed_scaling_factor=float(hf_config.routed_scaling_factor),
        n_group=n_group if grouped else 1, topk_group=topk_group if grouped else 1,
        first_k_dense_replace=first_dense, moe_layers=[i >= first_dense for i in range(num_layers)],
        num_mtp_layers=getattr(hf_config, "num_nextn_predict_layers", None) or 0)


def router_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` MoE arguments of the sigmoid router with shared experts."""
    grouped = arch["n_group"] > 1
    return dict(
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_intermediate_size"],
        moe_router_topk=arch["num_experts_per_tok"], moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_num_groups=arch["n_group"] if grouped else None,
        moe_router_group_topk=arch["topk_group"] if grouped else None,
        moe_router_topk_scaling_factor=arch["routed_scaling_factor"],
        moe_shared_expert_intermediate_size=arch["moe_intermediate_size"] * arch["n_shared_experts"],
        moe_layer_freq=[int(m) for m in arch["moe_layers"]])


def note_mtp_layers(arch: dict, hf_config) -> None:
    """Log (once per process and model directory) that the config's multi-token-prediction layers
    are not built."""
    key = (hf_config.model_type, getattr(hf_config, "name_or_path", ""), arch["num_mtp_layers"])
    if arch["num_mtp_layers"] and key not in _NOTED_MTP:
        _NOTED_MTP.add(key)
        first = arch["num_hidden_layers"]
        logger.warning("%s%s: %d multi-token-prediction layer(s) (HF model.layers.%d..%d) are dropped: "
                       "megarl builds and trains only the %d decoder layers; exports omit them",
                       hf_config.model_type, f" {key[1]}" if key[1] else "", arch["num_mtp_layers"], first,
                       first + arch["num_mtp_layers"] - 1, first)


def moe_layer_shapes(p: str, arch: dict) -> dict[str, tuple[int, ...]]:
    """Shapes of one sigmoid-router MoE MLP (router, bias, experts, shared experts) under prefix ``p``."""
    h, f, e = arch["hidden_size"], arch["moe_intermediate_size"], arch["num_experts"]
    s = f * arch["n_shared_experts"]
    out = {p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
           p + "mlp.shared_experts.linear_fc1.weight": (2 * s, h), p + "mlp.shared_experts.linear_fc2.weight": (h, s)}
    for i in range(e):
        out[p + f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = (2 * f, h)
        out[p + f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = (h, f)
    return out


def _yarn(hf_config, params: dict, arch: dict) -> dict:
    """Megatron YaRN fields reproducing HF's ``_compute_yarn_parameters`` + ``yarn_apply_mscale``."""
    if params.get("attention_factor") is not None:
        _reject(hf_config, "rope_parameters.attention_factor", params["attention_factor"],
                "Megatron derives it from mscale / mscale_all_dim")
    if params.get("truncate", True) is not True:
        _reject(hf_config, "rope_parameters.truncate", params["truncate"], "Megatron rounds the YaRN range")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or arch["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # HF uses mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are set, else mscale(f).
    both = bool(mscale and mscale_all_dim)
    return dict(rotary_scaling_factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(mscale) if both else 1.0, mscale_all_dim=float(mscale_all_dim or 0.0))  # type: ignore[arg-type]


def check_supported(hf_config) -> None:
    """Reject DeepSeek-V3 settings this family does not implement (names the HF field).

    A block-FP8 ``quantization_config`` (DeepSeek-V3's official release) is accepted: the weights
    are dequantised block by block while they are read (:mod:`megarl.conversion.hf_io`).

    Raises:
        ValueError: a quantisation other than block-wise e4m3 FP8, attention biases,
            non-interleaved rope, a rope type other than default/yarn, or an activation other than SiLU.
    """
    from megarl.models.fp8_blocks import parse_quantization_config

    parse_quantization_config(getattr(hf_config, "quantization_config", None),
                              where=f"HF config ({hf_config.model_type}) quantization_config")
    if getattr(hf_config, "attention_bias", False):
        _reject(hf_config, "attention_bias", True, "MLA projections without bias only")
    if getattr(hf_config, "rope_interleave", True) is not True:
        _reject(hf_config, "rope_interleave", hf_config.rope_interleave, "Megatron MLA rope is the interleaved one")
    if rope_settings(hf_config)[1] not in ("default", "yarn"):
        _reject(hf_config, "rope_type", rope_settings(hf_config)[1], "default or yarn only")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        _reject(hf_config, "hidden_act", hf_config.hidden_act, "SiLU only")


def architecture(hf_config) -> dict:
    """Canonical architecture of a DeepSeek-V3 HF config.

    ``head_dim`` is ``v_head_dim`` (columns per head of ``linear_proj``); ``num_key_value_heads``
    equals ``num_attention_heads`` (MLA up-projects a key and a value for every head).

    Raises:
        ValueError: an unsupported setting (see :func:`check_supported`, :func:`router_architecture`).
    """
    check_supported(hf_config)
    theta, rope_type = rope_settings(hf_config)
    heads = hf_config.num_attention_heads
    arch = dict(
        num_hidden_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hf_config.v_head_dim, vocab_size=hf_config.vocab_size, rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta, rope_type=rope_type, max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    arch["yarn"] = _yarn(hf_config, params, arch) if rope_type == "yarn" else None
    arch.update(router_architecture(hf_config, arch["num_hidden_layers"]))
    note_mtp_layers(arch, hf_config)
    return arch


def transformer_config_kwargs(arch: dict) -> dict:
    """``MLATransformerConfig`` architecture arguments (``multi_latent_attention=True``)."""
    yarn = arch["yarn"] or dict(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(
        num_layers=arch["num_hidden_layers"], hidden_size=arch["hidden_size"],
        ffn_hidden_size=arch["intermediate_size"], num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_attention_heads"],
        kv_channels=arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"],
        normalization="RMSNorm", layernorm_epsilon=arch["rms_norm_eps"], qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        init_method_std=arch["initializer_range"],
        multi_latent_attention=True, q_lora_rank=arch["q_lora_rank"], kv_lora_rank=arch["kv_lora_rank"],
        qk_head_dim=arch["qk_nope_head_dim"], qk_pos_emb_head_dim=arch["qk_rope_head_dim"],
        v_head_dim=arch["v_head_dim"], rope_type="yarn" if arch["yarn"] else "rope",
        rotary_base=arch["rope_theta"], rotary_percent=1.0, rotary_interleaved=False, **yarn,
        **router_config_kwargs(arch))


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments (MLA builds its own rotary embedding inside each attention layer)."""
    return dict(position_embedding_type="rope", rotary_base=arch["rope_theta"],
                share_embeddings_and_output_weights=arch["tie_word_embeddings"],
                max_sequence_length=arch["max_position_embeddings"])


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Full Megatron shapes (global local-spec names, unpadded vocabulary) of every parameter."""
    h, n = arch["hidden_size"], arch["num_attention_heads"]
    q_head = arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"]
    q_rank, kv_rank = arch["q_lora_rank"], arch["kv_lora_rank"]
    out = {"embedding.word_embeddings.weight": (arch["vocab_size"], h),
           "decoder.final_layernorm.weight": (h,), "output_layer.weight": (arch["vocab_size"], h)}
    for i, is_moe in enumerate(arch["moe_layers"]):
        p, a = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,)})
        if q_rank is None:
            out[a + "linear_q_proj.weight"] = (n * q_head, h)
        else:
            out.update({a + "linear_q_down_proj.weight": (q_rank, h), a + "q_layernorm.weight": (q_rank,),
                        a + "linear_q_up_proj.weight": (n * q_head, q_rank)})
        out.update({a + "linear_kv_down_proj.weight": (kv_rank + arch["qk_rope_head_dim"], h),
                    a + "kv_layernorm.weight": (kv_rank,),
                    a + "linear_kv_up_proj.weight": (n * (arch["qk_nope_head_dim"] + arch["v_head_dim"]), kv_rank),
                    a + "linear_proj.weight": (h, n * arch["v_head_dim"])})
        if is_moe:
            out.update(moe_layer_shapes(p, arch))
        else:
            out.update({p + "mlp.linear_fc1.weight": (2 * arch["intermediate_size"], h),
                        p + "mlp.linear_fc2.weight": (h, arch["intermediate_size"])})
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


ENGINE_LOAD_GROUPS = ((ATTN + "q_a_proj.weight", ATTN + "kv_a_proj_with_mqa.weight"),)
"""Tensors SGLang 0.5.23's DeepSeek loader must get in one ``load_weights`` call (``Family.engine_load_groups``).

``sglang/srt/models/deepseek_common/deepseek_weight_loader.py``: ``do_load_weights`` starts every
call with ``cached_a_proj = {}`` (lines 279-283, when ``q_lora_rank`` is set) and loads the fused
``fused_qkv_a_proj_with_mqa`` only once both ``q_a_proj`` and ``kv_a_proj_with_mqa`` of a layer are
in it (lines 438-513); one arriving alone is cached and dropped at the call's end, unreported. Their
block-FP8 ``weight_scale_inv`` fuse the same way (the names contain ``q_a_proj``); a weight's scale
always travels in its weight's bucket (``plan.Bucket.wire_tensors``), as does ``kv_b_proj``'s, which
``post_load_weights`` (lines 586-616) reads with the weight for the layers named in the call.
Everything else goes through its own ``weight_loader`` (stacked ``gate_proj``/``up_proj`` with a
shard id, lines 257-261, 372-399; experts' w1/w3/w2 with shard and expert ids, lines 400-427):
one tensor per call is enough. Without ``q_lora_rank`` (no ``q_a_proj``) nothing is cached."""

def tiny_moe_kwargs(spec, common: dict) -> tuple[dict, dict]:
    """``(MoE kwargs, common kwargs)`` of the sigmoid-router tiny models (DeepSeek-V3, GLM-4.5):
    routed scaling 2.5, ``n_shared_experts`` shared experts, ``first_k_dense_replace`` dense layers,
    no MTP layer; ``common`` without ``rope_theta`` / ``head_dim`` (each family sets its rope)."""
    moe = dict(
        intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts, first_k_dense_replace=spec.first_k_dense_replace,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=0)
    return moe, {k: v for k, v in common.items() if k not in ("rope_theta", "head_dim")}


def tiny_config(spec, common: dict):
    """The ``tiny:deepseek_v3`` config and model class (:attr:`Family.tiny_config`): MLA with q/kv
    LoRA ranks hidden/2, rope head dim head_dim/2, YaRN (factor 4, mscale_all_dim 1), interleaved
    rope, and group-limited routing (4 groups, top-k/2 groups) when top-k is even."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    moe, common = tiny_moe_kwargs(spec, common)
    k = spec.num_experts_per_tok
    grouped = k % 2 == 0 and spec.num_experts % 4 == 0 and spec.num_experts >= 8
    rope = {"rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 4,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    common["num_key_value_heads"] = spec.num_attention_heads  # MLA: every head has its own key and value
    cfg = DeepseekV3Config(  # type: ignore[call-arg]  # PretrainedConfig keeps the extra keys
        q_lora_rank=spec.hidden_size // 2, kv_lora_rank=spec.hidden_size // 2,
        qk_nope_head_dim=spec.head_dim, qk_rope_head_dim=spec.head_dim // 2, v_head_dim=spec.head_dim,
        n_group=4 if grouped else 1, topk_group=k // 2 if grouped else 1, rope_interleave=True,
        rope_parameters=rope, **moe, **common,
        # Fields of the released config.json that transformers ignores and SGLang reads.
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
    return cfg, DeepseekV3ForCausalLM


FAMILY = Family(name="deepseek_v3", twin_engine_tp2=True,  # engine TP 2 at CPU scale (Family.twin_engine_tp2)
                model_types=("deepseek_v3",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=gpt_model_kwargs,
                megatron_shapes=megatron_shapes, engine_load_groups=ENGINE_LOAD_GROUPS,
                # DeepSeek-V3 / R1: <think>...</think> (the R1 template opens it in the prompt);
                # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name ```json ...``` ...
                reasoning_parser="deepseek-v3", tool_call_parser="deepseekv3",
                # DeepSeek-V3.1 keeps V3's model_type; its template writes a call's name before the
                # separator: <｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜>
                parser_variants=(ParserVariant("deepseek_v31", "tool['function']['name'] + '<｜tool▁sep｜>'",
                                               "deepseek-v3", "deepseekv31"),),
                # srt/models/deepseek_v2.py (DeepseekV2ForCausalLM.__init__) shares embed_tokens when tied
                engine_class="sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM", engine_unties_lm_head=False,
                tiny_config=tiny_config, tiny_random_norms=True, tiny_mtp_layer=True)
