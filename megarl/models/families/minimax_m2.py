"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, model_type ``minimax_m2``): GQA with q/k RMSNorm over all heads
of a token, partial RoPE, and every layer a MoE of SwiGLU experts under a sigmoid router with an
expert bias; no shared expert, no dense layer. Read from transformers 5.19
``models/minimax_m2/modeling_minimax_m2.py`` and SGLang 0.5.23 ``srt/models/minimax_m2.py``.

Attention: ``q_norm`` / ``k_norm`` are RMSNorms of width ``heads * head_dim`` applied to the whole
``q_proj(x)`` / ``k_proj(x)`` of a token before the heads are split (one RMS per token, not per head),
then RoPE on the first ``rotary_dim = head_dim * partial_rotary_factor`` dims of each head
(``rotate_half``, non-interleaved: Megatron's ``rotary_percent``). Megatron-Core 0.16.1's q/k norms are
per head only, so the family's block spec (:attr:`Family.block_spec`,
``megarl.training.full_head_qk_norm.full_head_qk_norm_block_spec``) puts ``FullHeadRMSNorm`` in their
place (under TP it all-reduces the sum of squares, as SGLang's ``MiniMaxM2RMSNormTP``); the parameter
keeps Megatron's name and holds the whole ``[heads * head_dim]`` weight on every TP rank (a COPY,
replicated).

Router (HF ``MiniMaxM2TopKRouter``): ``s = sigmoid(x W^T)`` in fp32, experts chosen by top-k of
``s + e_score_correction_bias``, weights ``s_i / sum_k s_k`` (no scaling, no groups). Megatron:
``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias`` (its ``expert_bias``
buffer holds the HF bias, kept fixed: ``moe_router_bias_update_rate=0``), renormalised for k > 1 (a
top-1 router, whose HF weight is 1, is refused). The experts' width is ``intermediate_size``.

Checkpoint names (what transformers writes and SGLang loads): ``block_sparse_moe.gate.weight``,
``block_sparse_moe.e_score_correction_bias`` and ``block_sparse_moe.experts.{E}.w1`` (gate), ``w3``
(up), ``w2`` (down). SGLang reads fields transformers ignores: ``use_qk_norm``, ``qk_norm_type``,
``scoring_func``, ``use_routing_bias``, ``rotary_dim``; a config whose fields would make the engine
compute another function than transformers (and megarl) is refused. Multi-token-prediction modules
(``num_mtp_modules``, HF ``model.layers.{L >= num_hidden_layers}``) are not built.

The CUDA gap (``tests/gpu/test_minimax_m2_gpu.py`` on an H200, 2026-11-28: logits 0.32 from
transformers', layer 0's attention output 0.03, norms and MoE exact; CPU within 1e-5) was the
*reference*, not Megatron on CUDA: the GPU node had transformers 5.17.0, whose ``MiniMaxM2Config``
keeps ``rotary_dim`` as an opaque extra field (huggingface/transformers issue #48241, fixed by PR #48486
in the 5.19 installed here: ``convert_rope_params_to_dict`` maps it to ``partial_rotary_factor``), so
its ``MiniMaxM2RotaryEmbedding`` rotated all ``head_dim`` dims of a config that states only
``rotary_dim``, while megarl (and SGLang) rotate ``rotary_dim``. The tiny config now states the factor
in ``rope_parameters`` too (:func:`tiny_config`); ``tests/unit/models/test_minimax_m2_rotary.py``
reproduces the gap on CPU by reading the config as 5.17 does. A released checkpoint's ``config.json``
states only ``rotary_dim``: compare against transformers >= 5.19 (or SGLang), never an older one.
"""
from __future__ import annotations

from megarl.models.families import Family, hf_get, rope_settings
from megarl.models.families import qwen3_moe as qwen
from megarl.models.families.deepseek_v3 import note_mtp_layers
from megarl.models.table import Entry, TPSplit, Transform

C, G = Transform.COPY, Transform.GLU
HF = "model.layers.{L}."
MC = "decoder.layers.{L}."
MOE, EXPERT = HF + "block_sparse_moe.", HF + "block_sparse_moe.experts.{E}."

TABLE = {
    # q/k norms: Qwen3's rows (COPY, replicated), here [heads * head_dim] wide (full_head_qk_norm.py)
    **qwen.GLOBAL_TABLE, **qwen.ATTENTION_TABLE,
    MC + "mlp.router.weight": Entry((MOE + "gate.weight",), C, TPSplit.NONE),
    # Megatron's TopKRouter.expert_bias (a buffer; build_model makes it a frozen parameter).
    MC + "mlp.router.expert_bias": Entry((MOE + "e_score_correction_bias",), C, TPSplit.NONE),
    MC + "mlp.experts.local_experts.{E}.linear_fc1.weight": Entry(
        (EXPERT + "w1.weight", EXPERT + "w3.weight"), G, TPSplit.GLU, expert=True),
    MC + "mlp.experts.local_experts.{E}.linear_fc2.weight": Entry((EXPERT + "w2.weight",), C, TPSplit.ROW, expert=True),
}
"""Canonical (local-spec) names only (``megarl.models.mapping.canonical_name`` for TE names)."""


def _reject(field: str, value, why: str) -> None:
    raise ValueError(f"HF config {field}={value!r} is not supported by megarl's minimax_m2 mapping ({why})")


def _partial_rotary_factor(cfg, head_dim: int) -> float:
    """transformers' factor (``rope_parameters``, else ``rotary_dim / head_dim``), checked against
    SGLang's ``rotary_dim`` (default ``head_dim``)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    rotary_dim = getattr(cfg, "rotary_dim", None)
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if factor is None:
        factor = rotary_dim / head_dim if rotary_dim is not None else 1.0
    served = rotary_dim if rotary_dim is not None else head_dim
    if int(head_dim * factor) != served:
        _reject("rotary_dim", rotary_dim, f"transformers rotates head_dim * partial_rotary_factor = "
                f"{int(head_dim * factor)} dims, SGLang rotary_dim = {served}")
    return float(factor)


def check_supported(cfg) -> None:
    """Reject MiniMax-M2 settings megarl's mapping (or the engine's agreement with it) cannot express.

    Raises:
        ValueError: names the HF field: ``use_qk_norm`` not true, ``qk_norm_type`` other than
            ``per_layer``, ``scoring_func`` other than ``sigmoid``, ``use_routing_bias`` not true (SGLang
            reads these; transformers always norms q/k and routes by sigmoid + bias), an activation
            other than silu, a rope other than default, router jitter, top-1 routing, a shared expert,
            a linear-attention layer (``attn_type_list`` 0), a ``quantization_config``.
    """
    engine_fields = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                     "use_routing_bias": True}
    for field, wanted in engine_fields.items():
        if getattr(cfg, field, None) != wanted:
            _reject(field, getattr(cfg, field, None), f"SGLang 0.5.23 reads it and matches transformers "
                    f"only with {wanted!r} (srt/models/minimax_m2.py MiniMaxM2Attention / MiniMaxM2MoE)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _reject("hidden_act", cfg.hidden_act, "SwiGLU experts use silu")
    if rope_settings(cfg)[1] != "default":
        _reject("rope_type", rope_settings(cfg)[1], "default only")
    if getattr(cfg, "router_jitter_noise", 0.0):
        _reject("router_jitter_noise", cfg.router_jitter_noise, "Megatron's input jitter is not HF's")
    if cfg.num_experts_per_tok < 2:
        _reject("num_experts_per_tok", cfg.num_experts_per_tok, "Megatron does not renormalise a top-1 sigmoid weight")
    if getattr(cfg, "shared_intermediate_size", 0):
        _reject("shared_intermediate_size", cfg.shared_intermediate_size, "no shared expert is built")
    if 0 in (getattr(cfg, "attn_type_list", None) or []):
        _reject("attn_type_list", cfg.attn_type_list, "linear-attention layers (0) are not built")
    if getattr(cfg, "quantization_config", None):
        _reject("quantization_config", cfg.quantization_config, "convert from bf16 weights: the FP8 "
                "release's block_sparse_moe.gate is outside megarl.models.fp8_blocks' router rule")


def architecture(hf_config) -> dict:
    """Canonical architecture of a MiniMax-M2 HF config.

    Raises:
        ValueError: an unsupported setting (:func:`check_supported`, :func:`_partial_rotary_factor`).
    """
    cfg = hf_config
    check_supported(cfg)
    theta, rope_type = rope_settings(cfg)
    heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
    head_dim = hf_get(cfg, "head_dim", default=cfg.hidden_size // heads)
    arch = dict(
        num_hidden_layers=layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
        num_key_value_heads=hf_get(cfg, "num_key_value_heads", default=heads), head_dim=head_dim,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=theta, rope_type=rope_type,
        partial_rotary_factor=_partial_rotary_factor(cfg, head_dim),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        num_experts=hf_get(cfg, "num_local_experts", "num_experts"), num_experts_per_tok=cfg.num_experts_per_tok,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.intermediate_size,
        moe_layers=[True] * layers, num_mtp_layers=getattr(cfg, "num_mtp_modules", None) or 0)
    note_mtp_layers(arch, cfg)
    return arch


def transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments of MiniMax-M2: the Qwen3 families' attention and
    norms (``qk_layernorm``, widened by the block spec) and the bias-corrected sigmoid router."""
    return dict(
        qwen.common_transformer_config_kwargs(arch),
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_intermediate_size"],
        moe_router_topk=arch["num_experts_per_tok"], moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=None, moe_layer_freq=[1] * arch["num_hidden_layers"],
        moe_shared_expert_intermediate_size=None)


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments: rope on the first ``partial_rotary_factor`` of each head."""
    return dict(qwen.gpt_model_kwargs(arch), rotary_percent=arch["partial_rotary_factor"])


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Full Megatron shapes (global local-spec names, unpadded vocabulary) of every parameter."""
    h, hd, n, g = arch["hidden_size"], arch["head_dim"], arch["num_attention_heads"], arch["num_key_value_heads"]
    f, e = arch["moe_intermediate_size"], arch["num_experts"]
    out = {"embedding.word_embeddings.weight": (arch["vocab_size"], h),
           "decoder.final_layernorm.weight": (h,), "output_layer.weight": (arch["vocab_size"], h)}
    for i in range(arch["num_hidden_layers"]):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                    p + "self_attention.linear_qkv.weight": ((n + 2 * g) * hd, h),
                    p + "self_attention.q_layernorm.weight": (n * hd,),
                    p + "self_attention.k_layernorm.weight": (g * hd,),
                    p + "self_attention.linear_proj.weight": (h, n * hd),
                    p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,)})
        for x in range(e):
            out[p + f"mlp.experts.local_experts.{x}.linear_fc1.weight"] = (2 * f, h)
            out[p + f"mlp.experts.local_experts.{x}.linear_fc2.weight"] = (h, f)
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


ENGINE_LOAD_GROUPS: tuple = ()
"""None (``Family.engine_load_groups``). SGLang 0.5.23's ``MiniMaxM2ForCausalLM.load_weights``
(``sglang/srt/models/minimax_m2.py`` lines 1113-1225) fuses, each tensor into its own place in one call of
its parameter's ``weight_loader``: ``q_proj`` / ``k_proj`` / ``v_proj`` -> ``qkv_proj`` (shard ids q, k, v);
``block_sparse_moe.experts.{E}.w1`` / ``w3`` -> ``experts.w13_weight[E]`` (rows of w1, then of w3) and
``w2`` -> ``experts.w2_weight[E]`` (``FusedMoE.make_expert_params_mapping``); the stacked ``gate_up_proj``
mapping is never hit (no dense MLP). ``q_norm`` / ``k_norm`` go to ``MiniMaxM2RMSNormTP.weight_loader`` (its
heads' slice of the whole tensor; pre-sharded: ``megarl.weight_sync.sglang_compat.presharded_tp_norm_fix``),
``e_score_correction_bias`` to ``ebias_weight_loader``, the rest to their default loaders. Nothing is cached
across tensors or calls, so no pair must share a bucket."""


def tiny_config(spec, common: dict):
    """The ``tiny:minimax_m2`` config and model class (:attr:`Family.tiny_config`): every layer MoE
    (experts ``spec.moe_intermediate_size`` wide), partial RoPE as released (``rotary_dim =
    head_dim / 2``, also as ``rope_parameters.partial_rotary_factor`` so that every transformers
    release reads it: module docstring, "The CUDA gap"), and the released config's engine fields
    (``use_qk_norm``, ``scoring_func``, ...)."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    common = dict(common)
    # The factor is written out as well as rotary_dim: transformers before PR #48486 (5.17 among them)
    # ignores rotary_dim and would rotate the whole head (module docstring, "The CUDA gap")
    rope = {"rope_type": "default", "rope_theta": common.pop("rope_theta"), "partial_rotary_factor": 0.5}
    cfg = MiniMaxM2Config(  # type: ignore[call-arg]  # PretrainedConfig keeps the extra keys
        intermediate_size=spec.moe_intermediate_size, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, rope_parameters=rope, rotary_dim=spec.head_dim // 2,
        use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True, **common)
    return cfg, MiniMaxM2ForCausalLM


FAMILY = Family(name="minimax_m2", model_types=("minimax_m2",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=gpt_model_kwargs,
                megatron_shapes=megatron_shapes, engine_load_groups=ENGINE_LOAD_GROUPS,
                # q/k norms over all heads of a token: Megatron-Core's are per head only
                block_spec="megarl.training.full_head_qk_norm:full_head_qk_norm_block_spec", qk_norm_over_heads=True,
                # <think>...</think> (SGLang's "minimax": Qwen3's detector, reasoning forced on);
                # <minimax:tool_call><invoke name="..."><parameter name="...">...</parameter></invoke>
                reasoning_parser="minimax", tool_call_parser="minimax-m2",
                # srt/models/minimax_m2.py builds a ParallelLMHead of its own (never reads tie_word_embeddings)
                engine_class="sglang.srt.models.minimax_m2.MiniMaxM2ForCausalLM", engine_unties_lm_head=True,
                tiny_config=tiny_config, tiny_random_norms=True)
