"""gpt-oss (``GptOssForCausalLM``, 20B and 120B): GQA with biases on q/k/v/o and a learned
attention sink per head, sliding-window (128) and full attention layers alternating, YaRN RoPE
(non-interleaved), every layer MoE: a top-k router with bias (softmax over the k chosen logits)
and experts with biases and a clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)``
with ``g = clamp(gate, max=l)``.

Megatron-Core 0.16.1 expresses each piece: ``softmax_type="learnable"`` (the sinks are
``core_attention.softmax_offset``), ``window_size`` with ``window_attn_skip_freq`` as a per-layer
list, ``activation_func=quick_gelu`` (``x * sigmoid(1.702 x)``) with
``activation_func_clamp_value`` and ``glu_linear_offset=1`` (``megatron/core/transformer/mlp.py``,
``glu``), ``add_bias_linear`` / ``add_qkv_bias``, and a router bias (``TopKRouter`` with
``add_bias_linear``). HF's router takes the top-k logits and softmaxes them: Megatron's
``moe_router_pre_softmax=False``.

HF layout of the experts: one tensor per layer stacks every expert, in ``x @ W`` orientation:
``mlp.experts.gate_up_proj [E, H, 2F]`` whose columns alternate gate, up (``gate_up[..., ::2]`` is
the gate, ``GptOssExperts._apply_gate``), ``gate_up_proj_bias [E, 2F]`` (alternating too),
``down_proj [E, F, H]`` and ``down_proj_bias [E, H]``. The table names expert E's slice
(``gate_up_proj[{E}]``, :class:`~megarl.models.table.Entry`), de-interleaved and transposed into
Megatron's ``linear_fc1`` ``[gate; up]`` rows (``Transform.GLU_INTERLEAVED_T``) and ``linear_fc2``
(``Transform.TRANSPOSE``); exported checkpoints are stacked again, in the HF layout.

Weight sync: SGLang 0.5.23 loads a layer's experts only as whole stacks (:data:`ENGINE_LOAD_GROUPS`);
weight sync plans them per expert under the table :data:`SYNC_TABLE`, reading each trainer shard
through :func:`sync_shard_view`, keeps each stack's slices in one bucket and hands the stack over
whole (``megarl.weight_sync.stacked_experts``). SGLang captures gpt-oss's routes for routing replay
(R3): ``GptOssSparseMoeBlock`` builds ``TopK(layer_id=...)`` (``models/gpt_oss.py:221-225``), whose
``select_experts`` records them (``layers/moe/topk.py:3185``).

MXFP4: the released checkpoints store the expert weights as MXFP4 (``gate_up_proj_blocks`` /
``_scales``, ``quantization_config.quant_method == "mxfp4"``). megarl refuses such a config
(:func:`check_supported` names ``quantization_config``): no dequantising reader is written yet.
Convert first with transformers (``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
then ``save_pretrained``), which writes the bf16 layout above.
"""
from __future__ import annotations

from megarl.models.families import Family, hf_get, rope_settings
from megarl.models.families.qwen3_moe import GLOBAL_TABLE
from megarl.models.table import Entry, TPSplit, Transform

C, Q, GI, T = Transform.COPY, Transform.QKV, Transform.GLU_INTERLEAVED_T, Transform.TRANSPOSE
HF = "model.layers.{L}."
MC = "decoder.layers.{L}."
ATT = HF + "self_attn."
EXPERTS = HF + "mlp.experts."
LOCAL = MC + "mlp.experts.local_experts.{E}."

TABLE = {
    **GLOBAL_TABLE,
    MC + "input_layernorm.weight": Entry((HF + "input_layernorm.weight",), C, TPSplit.NONE),
    MC + "self_attention.linear_qkv.weight": Entry(
        (ATT + "q_proj.weight", ATT + "k_proj.weight", ATT + "v_proj.weight"), Q, TPSplit.COLUMN),
    MC + "self_attention.linear_qkv.bias": Entry(
        (ATT + "q_proj.bias", ATT + "k_proj.bias", ATT + "v_proj.bias"), Q, TPSplit.COLUMN),
    MC + "self_attention.linear_proj.weight": Entry((ATT + "o_proj.weight",), C, TPSplit.ROW),
    MC + "self_attention.linear_proj.bias": Entry((ATT + "o_proj.bias",), C, TPSplit.NONE),
    MC + "self_attention.core_attention.softmax_offset": Entry((ATT + "sinks",), C, TPSplit.COLUMN),
    MC + "pre_mlp_layernorm.weight": Entry((HF + "post_attention_layernorm.weight",), C, TPSplit.NONE),
    MC + "mlp.router.weight": Entry((HF + "mlp.router.weight",), C, TPSplit.NONE),
    MC + "mlp.router.bias": Entry((HF + "mlp.router.bias",), C, TPSplit.NONE),
    LOCAL + "linear_fc1.weight": Entry((EXPERTS + "gate_up_proj[{E}]",), GI, TPSplit.GLU, expert=True),
    LOCAL + "linear_fc1.bias": Entry((EXPERTS + "gate_up_proj_bias[{E}]",), GI, TPSplit.GLU, expert=True),
    LOCAL + "linear_fc2.weight": Entry((EXPERTS + "down_proj[{E}]",), T, TPSplit.ROW, expert=True),
    LOCAL + "linear_fc2.bias": Entry((EXPERTS + "down_proj_bias[{E}]",), C, TPSplit.NONE, expert=True),
}
"""Canonical (local-spec) names; the experts' HF names are slices of the stacked tensors."""

_FC1, _FC1_BIAS, _FC2 = (LOCAL + "linear_fc1.weight", LOCAL + "linear_fc1.bias", LOCAL + "linear_fc2.weight")
SYNC_TABLE = {
    **TABLE,
    _FC1: Entry((EXPERTS + "gate_up_proj[{E}]",), C, TPSplit.ROW, expert=True),
    _FC1_BIAS: Entry((EXPERTS + "gate_up_proj_bias[{E}]",), C, TPSplit.COLUMN, expert=True),
    _FC2: Entry((EXPERTS + "down_proj[{E}]",), C, TPSplit.COLUMN, expert=True),
}
"""The table weight sync plans with (:attr:`Family.sync_table`): the expert weights as
:func:`sync_shard_view` shows them, already in HF orientation, so each converts by a plain copy
and an ETP shard is one block of its HF slice (``gate_up_proj[E]`` columns, ``gate_up_proj_bias[E]``
and ``down_proj[E]`` rows). Weight sync's copy instructions trace row permutations only; the
transposes and the gate/up interleave happen in the view."""

ENGINE_LOAD_GROUPS = tuple((EXPERTS + f"{stack}[{{E}}]",) for stack in
                           ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
"""SGLang 0.5.23 loads a layer's experts only as whole stacks: the bf16 ``GptOssSparseMoeBlock``
builds its ``FusedMoE`` with ``use_weight_loader_fused`` (``models/gpt_oss.py:237``), whose
``weight_loader_fused`` copies the whole ``[E, ...]`` tensor into ``w13_weight`` / ``w2_weight``
(and their biases) at once (``layers/moe/fused_moe_triton/layer.py:1559``, ``param.data`` of every
local expert, no expert id); ``_load_normal_weights`` reaches it only through
``make_expert_params_mapping_fused`` (``models/gpt_oss.py:1215-1283``: checkpoint names
``experts.gate_up_proj`` / ``_bias``, ``experts.down_proj`` / ``_bias``, transposed there), with no
per-expert name. So each stack's E slices travel in one bucket and are handed to SGLang stacked
(:mod:`megarl.weight_sync.stacked_experts`); a slice sent alone is a name SGLang skips."""


def sync_shard_view(name: str, shard):
    """A trainer shard of ``name`` as weight sync reads it (:attr:`Family.sync_shard_view`, the
    :data:`SYNC_TABLE` layout); other parameters unchanged. A contiguous copy for the experts.

    Args:
        name: global Megatron name.
        shard: the rank's shard: ``linear_fc1.weight [2F/etp, H]`` (``[gate_k; up_k]``) ->
            ``[H, 2F/etp]`` with gate, up columns alternating (HF ``gate_up_proj`` columns of ETP
            block k); ``linear_fc1.bias [2F/etp]`` -> alternating; ``linear_fc2.weight [H, F/etp]``
            -> ``[F/etp, H]``. Works on ``meta`` tensors (shapes).
    """
    template = _sync_template(name)
    if template == _FC2:
        return shard.t().contiguous()
    if template in (_FC1, _FC1_BIAS):
        gate, up = shard.chunk(2, dim=0)
        interleaved = shard.new_empty(shard.shape)
        interleaved[0::2], interleaved[1::2] = gate, up
        return interleaved.t().contiguous() if shard.dim() == 2 else interleaved
    return shard


def _sync_template(name: str) -> str | None:
    """:data:`SYNC_TABLE`'s expert template of ``name`` (None for any other parameter)."""
    if ".local_experts." not in name or not name.endswith(("linear_fc1.weight", "linear_fc1.bias",
                                                           "linear_fc2.weight")):
        return None
    return LOCAL + name.rsplit(".local_experts.", 1)[1].split(".", 1)[1]

QUICK_GELU_ALPHA = 1.702
"""The sigmoid gain of Megatron's ``quick_gelu`` (``megatron/core/activations.py``)."""


def _reject(hf_config, field: str, value, why: str) -> None:
    raise ValueError(f"HF config {field}={value!r} is not supported by megarl's {hf_config.model_type} "
                     f"mapping ({why})")


def check_supported(hf_config) -> None:
    """Reject gpt-oss settings Megatron-Core (or this mapping) does not express.

    Raises:
        ValueError: names the HF field: an MXFP4 (or any) ``quantization_config``, no attention
            bias, a ``swiglu_alpha`` other than quick_gelu's 1.702, a rope other than default/yarn,
            a YaRN ``attention_factor``, a layer type other than sliding/full attention.
    """
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        _reject(hf_config, "quantization_config.quant_method", method,
                "dequantise the MXFP4 experts to bf16 with transformers first, see the module docstring")
    if not getattr(hf_config, "attention_bias", True):
        _reject(hf_config, "attention_bias", False, "q/k/v/o and MLP biases go together in Megatron's add_bias_linear")
    if float(hf_config.swiglu_alpha) != QUICK_GELU_ALPHA:
        _reject(hf_config, "swiglu_alpha", hf_config.swiglu_alpha, "Megatron's quick_gelu has 1.702")
    if rope_settings(hf_config)[1] not in ("default", "yarn"):
        _reject(hf_config, "rope_type", rope_settings(hf_config)[1], "default or yarn only")
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("attention_factor") is not None:
        _reject(hf_config, "rope_parameters.attention_factor", params["attention_factor"],
                "Megatron derives it from the factor")
    bad = sorted(set(hf_config.layer_types) - {"sliding_attention", "full_attention"})
    if bad:
        _reject(hf_config, "layer_types", bad, "sliding_attention / full_attention only")


def _yarn(hf_config, arch: dict) -> dict | None:
    """Megatron YaRN fields reproducing HF's ``_compute_yarn_parameters`` (mscale 0.1 ln(f) + 1;
    ``truncate: false`` keeps the correction range unrounded)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if rope_settings(hf_config)[1] != "yarn":
        return None
    original = params["original_max_position_embeddings"]
    return dict(rotary_scaling_factor=float(params.get("factor") or arch["max_position_embeddings"] / original),
                original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=1.0, mscale_all_dim=0.0,
                correction_range_round_to_int=bool(params.get("truncate", True)))


def architecture(hf_config) -> dict:
    """Canonical architecture of a gpt-oss HF config.

    Raises:
        ValueError: an unsupported setting (:func:`check_supported`).
    """
    check_supported(hf_config)
    theta, rope_type = rope_settings(hf_config)
    heads = hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    arch = dict(
        num_hidden_layers=layers, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, moe_intermediate_size=hf_config.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=hf_get(hf_config, "num_key_value_heads", default=heads),
        head_dim=hf_get(hf_config, "head_dim", default=hf_config.hidden_size // heads),
        vocab_size=hf_config.vocab_size, rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta, rope_type=rope_type, max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        num_experts=hf_get(hf_config, "num_local_experts", "num_experts"),
        num_experts_per_tok=hf_config.num_experts_per_tok, moe_layers=[True] * layers,
        sliding_window=hf_config.sliding_window,
        sliding_layers=[t == "sliding_attention" for t in hf_config.layer_types],
        swiglu_limit=float(hf_config.swiglu_limit))
    arch["yarn"] = _yarn(hf_config, arch)
    return arch


def transformer_config_kwargs(arch: dict) -> dict:
    """``TransformerConfig`` architecture arguments of gpt-oss (YaRN fields as ``yarn_*``)."""
    from megatron.core.activations import quick_gelu

    window = arch["sliding_window"] if any(arch["sliding_layers"]) else None
    yarn = {f"yarn_{k}": v for k, v in (arch["yarn"] or {}).items()}
    return dict(
        num_layers=arch["num_hidden_layers"], hidden_size=arch["hidden_size"],
        ffn_hidden_size=arch["intermediate_size"], num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_key_value_heads"], kv_channels=arch["head_dim"],
        normalization="RMSNorm", layernorm_epsilon=arch["rms_norm_eps"], qk_layernorm=False,
        gated_linear_unit=True, activation_func=quick_gelu, activation_func_clamp_value=arch["swiglu_limit"],
        glu_linear_offset=1.0, add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable",
        # HF: key j is seen from query i when i - window < j <= i; flash-attn's (left, right) window
        window_size=(window - 1, 0) if window else None,
        window_attn_skip_freq=[int(s) for s in arch["sliding_layers"]] if window else None,
        init_method_std=arch["initializer_range"],
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_intermediate_size"],
        moe_router_topk=arch["num_experts_per_tok"], moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_layer_freq=[1] * arch["num_hidden_layers"],
        moe_shared_expert_intermediate_size=None, **yarn)


def gpt_model_kwargs(arch: dict) -> dict:
    """``GPTModel`` arguments (YaRN or plain RoPE, untied embeddings, max length)."""
    return dict(position_embedding_type="yarn" if arch["yarn"] else "rope", rotary_percent=1.0,
                rotary_base=arch["rope_theta"], share_embeddings_and_output_weights=arch["tie_word_embeddings"],
                max_sequence_length=arch["max_position_embeddings"])


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Full Megatron shapes (global local-spec names, unpadded vocabulary) of every parameter."""
    h, hd, n, f = arch["hidden_size"], arch["head_dim"], arch["num_attention_heads"], arch["moe_intermediate_size"]
    qkv_rows = (n + 2 * arch["num_key_value_heads"]) * hd
    out = {"embedding.word_embeddings.weight": (arch["vocab_size"], h),
           "decoder.final_layernorm.weight": (h,), "output_layer.weight": (arch["vocab_size"], h)}
    for i in range(arch["num_hidden_layers"]):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                    p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                    p + "self_attention.linear_qkv.bias": (qkv_rows,),
                    p + "self_attention.linear_proj.weight": (h, n * hd), p + "self_attention.linear_proj.bias": (h,),
                    p + "self_attention.core_attention.softmax_offset": (n,),
                    p + "mlp.router.weight": (arch["num_experts"], h), p + "mlp.router.bias": (arch["num_experts"],)})
        for e in range(arch["num_experts"]):
            q = p + f"mlp.experts.local_experts.{e}."
            out.update({q + "linear_fc1.weight": (2 * f, h), q + "linear_fc1.bias": (2 * f,),
                        q + "linear_fc2.weight": (h, f), q + "linear_fc2.bias": (h,)})
    if arch["tie_word_embeddings"]:
        out.pop("output_layer.weight")
    return out


def tiny_config(spec, common: dict):
    """The ``tiny:gpt_oss`` config and model class (:attr:`Family.tiny_config`): sliding (window 4,
    shorter than the tests' sequences) and full layers alternating, YaRN as released (factor 32,
    unrounded range), clamped SwiGLU with the release's limit 7; the builder gives its zero-initialised
    biases (q/k/v/o, experts) seeded random values so a misplaced bias changes the logits."""
    from transformers import GptOssConfig, GptOssForCausalLM

    common = dict(common)
    theta = common.pop("rope_theta")
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": max(common["max_position_embeddings"] // 32, 1)}
    cfg = GptOssConfig(intermediate_size=spec.moe_intermediate_size, num_local_experts=spec.num_experts,
                       num_experts_per_tok=spec.num_experts_per_tok, sliding_window=4, rope_parameters=rope,
                       swiglu_limit=7.0, attention_bias=True, **common)
    return cfg, _tiny_model_class(GptOssForCausalLM)


def _tiny_model_class(base):
    """``base`` with its zero-initialised biases replaced by seeded N(0, 0.02) values (the global
    RNG, which the tiny builder seeds); same class name, so ``config.architectures`` is unchanged."""
    import torch

    class GptOssForCausalLM(base):  # type: ignore[valid-type, misc]  # the transformers class, given
        def __init__(self, config):
            super().__init__(config)
            with torch.no_grad():
                for name, param in self.named_parameters():
                    if name.endswith("bias") and not param.any():
                        param.normal_(0.0, 0.02)

    GptOssForCausalLM.__qualname__ = base.__qualname__
    GptOssForCausalLM.__module__ = base.__module__
    return GptOssForCausalLM


FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=gpt_model_kwargs,
                megatron_shapes=megatron_shapes,
                # harmony: <|channel|>analysis<|message|>... reasoning; to=functions.name tool calls
                reasoning_parser="gpt-oss", tool_call_parser="gpt-oss",
                # srt/models/gpt_oss.py builds a ParallelLMHead of its own (never reads tie_word_embeddings)
                engine_class="sglang.srt.models.gpt_oss.GptOssForCausalLM", engine_unties_lm_head=True,
                engine_load_groups=ENGINE_LOAD_GROUPS, sync_table=SYNC_TABLE, sync_shard_view=sync_shard_view,
                tiny_config=tiny_config, tiny_random_norms=True)
