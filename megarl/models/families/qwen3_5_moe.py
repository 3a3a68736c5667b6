"""Qwen3.5-MoE, the language model (transformers 5 ``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``).
The release's vision-language ``qwen3_5_moe`` config (``text_config``, tensors under
``model.language_model.``) is not registered yet.

Layers alternate by ``layer_types``: ``linear_attention`` layers are a gated DeltaNet (a causal
depthwise conv over ``[q; k; v]``, L2-normalised q/k, the gated delta rule with per-head decay
``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, an RMSNorm of each value head
gated by ``silu(z)``), ``full_attention`` layers are GQA with q/k RMSNorm, partial RoPE (first
``partial_rotary_factor`` of each head) and an output gate (``o_proj(attn * sigmoid(gate))``, the
gate from the second half of each head's ``q_proj`` rows). Every layer is MoE: a softmax top-k
router with the k weights renormalised (Megatron's ``moe_router_pre_softmax=False``), SwiGLU
experts and one shared expert scaled by ``sigmoid(shared_expert_gate(x))``. The layer norms, the
final norm and q/k norms are zero-centred (``x_normed * (1 + w)``); the DeltaNet's gated norm is not.

Megatron-Core 0.16.1 names each piece: ``experimental_attention_variant="gated_delta_net"`` with
``linear_attention_freq`` as a per-layer list (1 = DeltaNet), ``attention_output_gate``,
``layernorm_zero_centered_gamma``, ``moe_shared_expert_gate``, ``rotary_percent``. Its own layer
specs for them need Transformer Engine and the ``fla`` kernels; the family's block spec
(:attr:`Family.block_spec`) is :func:`megarl.training.local_gdn.hybrid_block_spec`: its local (CPU) one,
or Megatron's under Transformer Engine with the DeltaNet's gated norm fixed.

Text RoPE: the release's interleaved M-RoPE (``mrope_section``) gives every frequency the same
position for text (the three position rows are equal), i.e. plain RoPE, which is what megarl runs.
Multi-token-prediction tensors (``mtp.*``, ``mtp_num_hidden_layers``) are not imported.
"""
from __future__ import annotations

from megarl.models.families import Family, hf_get, rope_settings
from megarl.models.families.qwen3_moe import GLOBAL_TABLE, MOE_TABLE, common_transformer_config_kwargs
from megarl.models.table import Entry, TPSplit, Transform

C, G = Transform.COPY, Transform.GLU
HF = "model.layers.{L}."
MC = "decoder.layers.{L}."
ATT, LIN, SA = HF + "self_attn.", HF + "linear_attn.", MC + "self_attention."

TABLE = {
    **GLOBAL_TABLE, **MOE_TABLE,
    MC + "input_layernorm.weight": Entry((HF + "input_layernorm.weight",), C, TPSplit.NONE),
    MC + "pre_mlp_layernorm.weight": Entry((HF + "post_attention_layernorm.weight",), C, TPSplit.NONE),
    # full attention (gated)
    SA + "linear_qkv.weight": Entry((ATT + "q_proj.weight", ATT + "k_proj.weight", ATT + "v_proj.weight"),
                                    Transform.QKV_GATED, TPSplit.COLUMN),
    SA + "q_layernorm.weight": Entry((ATT + "q_norm.weight",), C, TPSplit.NONE),
    SA + "k_layernorm.weight": Entry((ATT + "k_norm.weight",), C, TPSplit.NONE),
    SA + "linear_proj.weight": Entry((ATT + "o_proj.weight",), C, TPSplit.ROW),
    # gated DeltaNet
    SA + "in_proj.weight": Entry((LIN + "in_proj_qkv.weight", LIN + "in_proj_z.weight", LIN + "in_proj_b.weight",
                                  LIN + "in_proj_a.weight"), Transform.GDN_IN_PROJ, TPSplit.GDN_IN_PROJ),
    SA + "conv1d.weight": Entry((LIN + "conv1d.weight",), C, TPSplit.GDN_CONV),
    SA + "dt_bias": Entry((LIN + "dt_bias",), C, TPSplit.COLUMN),
    SA + "A_log": Entry((LIN + "A_log",), C, TPSplit.COLUMN),
    SA + "out_norm.weight": Entry((LIN + "norm.weight",), C, TPSplit.NONE),
    SA + "out_proj.weight": Entry((LIN + "out_proj.weight",), C, TPSplit.ROW),
    # shared expert and its gate
    MC + "mlp.shared_experts.linear_fc1.weight": Entry(
        (HF + "mlp.shared_expert.gate_proj.weight", HF + "mlp.shared_expert.up_proj.weight"), G, TPSplit.GLU),
    MC + "mlp.shared_experts.linear_fc2.weight": Entry((HF + "mlp.shared_expert.down_proj.weight",), C, TPSplit.ROW),
    MC + "mlp.shared_experts.gate_weight": Entry((HF + "mlp.shared_expert_gate.weight",), C, TPSplit.NONE),
}
"""Canonical (local-spec) names; a layer has the attention rows or the DeltaNet rows by its type."""

LAYER_TYPES = ("linear_attention", "full_attention")


def _reject(field: str, value, why: str) -> None:
    raise ValueError(f"HF config {field}={value!r} is not supported by megarl's qwen3_5_moe mapping ({why})")


def check_supported(cfg) -> None:
    """Reject Qwen3.5-MoE settings this mapping does not express.

    Raises:
        ValueError: names the HF field: attention bias, an activation other than silu, a rope other
            than default, a layer type other than linear/full attention, value heads not a multiple
            of key heads (DeltaNet GQA).
    """
    if getattr(cfg, "attention_bias", False):
        _reject("attention_bias", True, "Megatron's linear_qkv carries no bias here")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _reject("hidden_act", cfg.hidden_act, "SwiGLU and the DeltaNet conv / gate use silu")
    if rope_settings(cfg)[1] != "default":
        _reject("rope_type", rope_settings(cfg)[1], "default only")
    bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if bad:
        _reject("layer_types", bad, "linear_attention / full_attention only")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        _reject("linear_num_value_heads", cfg.linear_num_value_heads, "a multiple of linear_num_key_heads")


def architecture(hf_config) -> dict:
    """Canonical architecture of a ``qwen3_5_moe_text`` config.

    Raises:
        ValueError: an unsupported setting (:func:`check_supported`).
    """
    cfg = hf_config
    check_supported(cfg)
    theta, rope_type = rope_settings(cfg)
    params = getattr(cfg, "rope_parameters", None) or {}
    heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
    return dict(
        num_hidden_layers=layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
        num_key_value_heads=hf_get(cfg, "num_key_value_heads", default=heads),
        head_dim=hf_get(cfg, "head_dim", default=cfg.hidden_size // heads), vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=theta, rope_type=rope_type,
        partial_rotary_factor=float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        linear_layers=[t == "linear_attention" for t in cfg.layer_types],
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_dim=cfg.linear_key_head_dim * cfg.linear_num_key_heads,
        linear_value_dim=cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, moe_layers=[True] * layers)


def transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments of Qwen3.5-MoE: the Qwen3 families' common ones,
    with zero-centred norms, the gated attention output, the gated-DeltaNet layers and the MoE."""
    return dict(
        common_transformer_config_kwargs(arch), layernorm_zero_centered_gamma=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(x) for x in arch["linear_layers"]],
        linear_conv_kernel_dim=arch["linear_conv_kernel_dim"], linear_key_head_dim=arch["linear_key_head_dim"],
        linear_value_head_dim=arch["linear_value_head_dim"], linear_num_key_heads=arch["linear_num_key_heads"],
        linear_num_value_heads=arch["linear_num_value_heads"],
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_intermediate_size"],
        moe_router_topk=arch["num_experts_per_tok"], moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_layer_freq=[1] * arch["num_hidden_layers"],
        moe_shared_expert_intermediate_size=arch["shared_expert_intermediate_size"], moe_shared_expert_gate=True)


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments (partial RoPE, tied embeddings, max length)."""
    return dict(position_embedding_type="rope", rotary_percent=arch["partial_rotary_factor"],
                rotary_base=arch["rope_theta"], share_embeddings_and_output_weights=arch["tie_word_embeddings"],
                max_sequence_length=arch["max_position_embeddings"])


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Full Megatron shapes (global local-spec names, unpadded vocabulary) of every parameter."""
    h, hd, n, g = arch["hidden_size"], arch["head_dim"], arch["num_attention_heads"], arch["num_key_value_heads"]
    k, v, vh = arch["linear_key_dim"], arch["linear_value_dim"], arch["linear_num_value_heads"]
    f, s, e = arch["moe_intermediate_size"], arch["shared_expert_intermediate_size"], arch["num_experts"]
    out = {"embedding.word_embeddings.weight": (arch["vocab_size"], h),
           "decoder.final_layernorm.weight": (h,), "output_layer.weight": (arch["vocab_size"], h)}
    for i, linear in enumerate(arch["linear_layers"]):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                    p + "mlp.router.weight": (e, h), p + "mlp.shared_experts.linear_fc1.weight": (2 * s, h),
                    p + "mlp.shared_experts.linear_fc2.weight": (h, s), p + "mlp.shared_experts.gate_weight": (1, h)})
        if linear:
            out.update({a + "in_proj.weight": (2 * k + 2 * v + 2 * vh, h),
                        a + "conv1d.weight": (2 * k + v, 1, arch["linear_conv_kernel_dim"]),
                        a + "dt_bias": (vh,), a + "A_log": (vh,),
                        a + "out_norm.weight": (arch["linear_value_head_dim"],),
                        a + "out_proj.weight": (h, v)})
        else:
            out.update({a + "linear_qkv.weight": ((2 * n + 2 * g) * hd, h), a + "q_layernorm.weight": (hd,),
                        a + "k_layernorm.weight": (hd,), a + "linear_proj.weight": (h, n * hd)})
        for x in range(e):
            out[p + f"mlp.experts.local_experts.{x}.linear_fc1.weight"] = (2 * f, h)
            out[p + f"mlp.experts.local_experts.{x}.linear_fc2.weight"] = (h, f)
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


def tiny_config(spec, common: dict):
    """The ``tiny:qwen3_5_moe`` config and model class (:attr:`Family.tiny_config`): four layers per
    ``spec.num_hidden_layers // 4`` block, three DeltaNet layers then one gated attention layer as
    released (at least one of each), DeltaNet GQA (2 key heads, 4 value heads), partial RoPE 0.25,
    one shared expert of twice the experts' width (64 rows at the default 32: SGLang's CPU server at TP 2 pads a
    narrower one to ``TP x 32`` rows, ``configs/update_config.py`` ``adjust_config_with_unaligned_cpu_tp`` lines
    290-301, and its row-parallel ``down_proj`` then refuses a pre-sharded slice; the routed experts' FusedMoE
    takes padded slices), ``full_attention_interval`` in ``config.json`` where it
    describes the same layers (SGLang reads it). The builder gives the DeltaNet's constant initial
    ``dt_bias`` (1) and gated-norm weight (1) seeded random values, so a misplaced one changes the logits."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    common = dict(common)
    theta = common.pop("rope_theta")
    layers = max(common.pop("num_hidden_layers"), 2)
    layer_types = ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
                   for i in range(layers)]
    cfg = Qwen3_5MoeTextConfig(
        num_hidden_layers=layers, layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=spec.head_dim,
        linear_value_head_dim=spec.head_dim, linear_conv_kernel_dim=4,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=2 * spec.moe_intermediate_size,
        num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok, **common)
    if layers <= 4 or layers % 4 == 0:
        # As the release's config.json: SGLang 0.5.23 derives the layer kinds from it, not from
        # layer_types (configs/qwen3_next.py, layers_block_type); transformers drops the argument.
        cfg.full_attention_interval = min(layers, 4)
    return cfg, _tiny_model_class(Qwen3_5MoeForCausalLM)


def _tiny_model_class(base):
    """``base`` with each DeltaNet's ``dt_bias`` and gated-norm weight drawn around 1 from the global
    RNG (which the tiny builder seeds); same class name, so ``config.architectures`` is unchanged."""
    import torch

    class Qwen3_5MoeForCausalLM(base):  # type: ignore[valid-type, misc]  # the transformers class, given
        def __init__(self, config):
            super().__init__(config)
            with torch.no_grad():
                for name, param in self.named_parameters():
                    if name.endswith(("linear_attn.dt_bias", "linear_attn.norm.weight")):
                        param.copy_(1.0 + 0.1 * torch.randn_like(param))

    Qwen3_5MoeForCausalLM.__qualname__ = base.__qualname__
    Qwen3_5MoeForCausalLM.__module__ = base.__module__
    return Qwen3_5MoeForCausalLM


FAMILY = Family(name="qwen3_5_moe", model_types=("qwen3_5_moe_text",), table=TABLE,
                architecture=architecture, transformer_config_kwargs=transformer_config_kwargs,
                gpt_model_kwargs=gpt_model_kwargs, megatron_shapes=megatron_shapes,
                # <think>...</think>; <tool_call><function=name><parameter=...> (the qwen3_coder format)
                reasoning_parser="qwen3", tool_call_parser="qwen3_coder",
                # srt/models/qwen3_5_text.py lines 94-95: lm_head = embed_tokens when tie_word_embeddings
                engine_class="sglang.srt.models.qwen3_5_text.Qwen3_5MoeForCausalLM", engine_unties_lm_head=False,
                tiny_config=tiny_config, tiny_random_norms=True,
                # gated-DeltaNet and gated-attention layers (Megatron's GPT block spec has no DeltaNet)
                block_spec="megarl.training.local_gdn:hybrid_block_spec")
