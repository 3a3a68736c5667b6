"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, model_type ``deepseek_v32``): DeepSeek-V3 (MLA, the
sigmoid-router MoE with shared experts, :mod:`megarl.models.families.deepseek_v3`) with DeepSeek
Sparse Attention: in every layer a lightning indexer scores the keys of each query and the MLA
softmax only sees the ``index_topk`` best (and causal) ones.

Indexer (transformers ``DeepseekV32Indexer``; Megatron-Core 0.16.1 ``DSAIndexer``, its
``experimental_attention_variant="dsa"`` with ``dsa_indexer_n_heads`` / ``_head_dim`` / ``_topk``):
``q = wq_b(q_resid)`` (``q_resid`` = the q latent after ``q_a_layernorm``, Megatron's ``qr``),
``k = LayerNorm(wk(x))`` (one key head, weight and bias, eps 1e-6), rope on ``qk_rope_head_dim``
dims of each, ``w = weights_proj(x) / sqrt(index_n_heads)``,
``score[s, t] = sum_h w[s, h] relu(q[s, h] . k[t] / sqrt(index_head_dim))``, causal mask, top-k.
HF rotates the first rope dims in half-split pairs; Megatron rotates the last ones with MLA's
interleaved rope, so ``wq_b`` / ``wk`` rows and the key norm are permuted per head on conversion
(:data:`INDEXER_ROPE`, this family's own transform); every score is unchanged. The
reference's Hadamard rotation of q and k (and its FP8 scoring) is orthogonal and transformers
skips it; megarl's local modules (:mod:`megarl.training.local_dsa`) skip it too.

The indexer takes the layer input detached (Megatron trains it only through its KL loss,
``dsa_indexer_loss_coeff``, 0 here: RL keeps the released indexer; top-k gives it no gradient).
Multi-token-prediction layers are dropped as for DeepSeek-V3.
"""
from __future__ import annotations

import torch

from megarl.models.families import Family
from megarl.models.families import deepseek_v3 as v3
from megarl.models.table import Entry, FamilyTransform, ModelLayout, TPSplit, Transform


def indexer_rope_order(layout: ModelLayout) -> torch.Tensor:
    """For each Megatron row of one DSA indexer head, the HF row it holds (:data:`INDEXER_ROPE`):
    ``[r, ..., D - 1]`` (the unrotated dims) then ``0, r/2, 1, r/2 + 1, ...`` (the rotated pairs
    interleaved). ``D`` = ``layout.index_head_dim``, ``r`` = ``layout.index_rope_dim``; int64 ``[D]``.

    Raises:
        ValueError: the layout has no indexer dims, or ``r`` is odd or larger than ``D``.
    """
    d, r = layout.index_head_dim, layout.index_rope_dim
    if not d or r % 2 or not 0 < r <= d:
        raise ValueError(f"{layout.family}: the DSA indexer transform needs index_head_dim >= index_rope_dim > 0, "
                         f"rope dims even (got {d}, {r})")
    rope = torch.stack([torch.arange(r // 2), torch.arange(r // 2, r)], dim=1).reshape(-1)
    return torch.cat([torch.arange(r, d), rope])


def _permute_head_rows(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``t`` (rows = heads x ``len(order)``) with each head's rows taken in ``order``."""
    return t.reshape(-1, len(order), *t.shape[1:])[:, order].reshape(t.shape)


def _rope_rows_to_megatron(hf_tensors, layout: ModelLayout) -> torch.Tensor:
    return _permute_head_rows(hf_tensors[0], indexer_rope_order(layout))


def _rope_rows_to_hf(full: torch.Tensor, layout: ModelLayout) -> list[torch.Tensor]:
    return [_permute_head_rows(full, torch.argsort(indexer_rope_order(layout)))]


INDEXER_ROPE = FamilyTransform("dsa_indexer_rope", _rope_rows_to_megatron, _rope_rows_to_hf)
"""The DSA lightning indexer's query/key rows: rows per indexer head of ``index_head_dim`` D, the
first ``index_rope_dim`` r of them rotated. HF rows per head ``[rope (half-split pairs i, i + r/2);
pass]`` (transformers' ``DeepseekV32Indexer``) become Megatron's ``[pass; rope (interleaved pairs
2i, 2i + 1)]`` (Megatron-Core 0.16.1 ``dsa.py`` ``DSAIndexer._apply_rope``: nope first, MLA's
de-interleaving rope): the same vectors after rope, permuted alike for queries and keys, so every
q . k is unchanged. Applies to ``wq_b`` rows, ``wk`` rows and the key LayerNorm's weight and bias (a
LayerNorm commutes with a permutation)."""

HF = "model.layers.{L}.self_attn.indexer."
MC = "decoder.layers.{L}.self_attention.core_attention.indexer."
R, C = INDEXER_ROPE, Transform.COPY

INDEXER_TABLE = {
    # Replicated over TP (Megatron builds them "duplicated"): every rank scores every key.
    MC + "linear_wq_b.weight": Entry((HF + "wq_b.weight",), R, TPSplit.NONE),
    MC + "linear_wk.weight": Entry((HF + "wk.weight",), R, TPSplit.NONE),
    MC + "k_norm.weight": Entry((HF + "k_norm.weight",), R, TPSplit.NONE),
    MC + "k_norm.bias": Entry((HF + "k_norm.bias",), R, TPSplit.NONE),
    MC + "linear_weights_proj.weight": Entry((HF + "weights_proj.weight",), C, TPSplit.NONE),
}

TABLE = {**v3.TABLE, **INDEXER_TABLE}


def _reject(field: str, value, why: str) -> None:
    raise ValueError(f"HF config {field}={value!r} is not supported by megarl's deepseek_v32 mapping: {why}")


def architecture(hf_config) -> dict:
    """Canonical architecture of a DeepSeek-V3.2 HF config: DeepSeek-V3's
    (:func:`megarl.models.families.deepseek_v3.architecture`) plus the indexer's
    ``index_n_heads``, ``index_head_dim``, ``index_topk`` and ``index_rope_dim`` (= ``qk_rope_head_dim``).

    Raises:
        ValueError: a DeepSeek-V3 refusal; no q LoRA (the indexer reads the q latent); an indexer
            head smaller than the rope dims; ``mlp_layer_types`` other than ``first_k_dense_replace``
            dense layers then MoE (SGLang builds the layers by ``first_k_dense_replace``).
    """
    arch = v3.architecture(hf_config)
    if arch["q_lora_rank"] is None:
        _reject("q_lora_rank", None, "the indexer's queries come from the q latent (q_lora_rank must be set)")
    heads, head_dim, topk = hf_config.index_n_heads, hf_config.index_head_dim, hf_config.index_topk
    if head_dim < arch["qk_rope_head_dim"]:
        _reject("index_head_dim", head_dim, f"at least qk_rope_head_dim={arch['qk_rope_head_dim']}")
    if topk < 1:
        _reject("index_topk", topk, "at least 1")
    types = getattr(hf_config, "mlp_layer_types", None)
    if types is not None and [t == "sparse" for t in types] != arch["moe_layers"]:
        _reject("mlp_layer_types", types, f"first_k_dense_replace={arch['first_k_dense_replace']} dense layers, "
                "then MoE layers")
    arch.update(index_n_heads=heads, index_head_dim=head_dim, index_topk=topk,
                index_rope_dim=arch["qk_rope_head_dim"])
    return arch


def transformer_config_kwargs(arch: dict) -> dict:
    """DeepSeek-V3's ``MLATransformerConfig`` arguments plus ``experimental_attention_variant="dsa"``
    and the indexer's sizes; the indexer's KL loss is off (``dsa_indexer_loss_coeff=0``)."""
    return dict(v3.transformer_config_kwargs(arch), experimental_attention_variant="dsa",
                dsa_indexer_n_heads=arch["index_n_heads"], dsa_indexer_head_dim=arch["index_head_dim"],
                dsa_indexer_topk=arch["index_topk"], dsa_indexer_loss_coeff=0.0)


def megatron_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's shapes plus each layer's indexer (``linear_wq_b [heads * D, q_lora_rank]``,
    ``linear_wk [D, hidden]``, ``k_norm`` weight and bias ``[D]``, ``linear_weights_proj [heads, hidden]``)."""
    out = v3.megatron_shapes(arch)
    d, heads, h = arch["index_head_dim"], arch["index_n_heads"], arch["hidden_size"]
    for i in range(arch["num_hidden_layers"]):
        p = f"decoder.layers.{i}.self_attention.core_attention.indexer."
        out.update({p + "linear_wq_b.weight": (heads * d, arch["q_lora_rank"]), p + "linear_wk.weight": (d, h),
                    p + "k_norm.weight": (d,), p + "k_norm.bias": (d,), p + "linear_weights_proj.weight": (heads, h)})
    return out


def tiny_config(spec, common: dict):
    """The ``tiny:deepseek_v32`` config and model class (:attr:`Family.tiny_config`): the tiny
    DeepSeek-V3 (:func:`megarl.models.families.deepseek_v3.tiny_config`'s MLA, YaRN and grouped
    router) with an indexer of 8 heads of ``head_dim`` (rope on the first ``head_dim / 2``) keeping
    the top 8 keys, so sequences longer than 8 attend sparsely (8 heads: a key scores exactly 0,
    a tie ``topk`` may break either way, only when all 8 ReLUs are 0). The model class gives the key
    norm's constant initial weight (1) and bias (0) seeded random values."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    v3_cfg, _ = v3.tiny_config(spec, common)
    fields = v3_cfg.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "rope_interleave", "num_mtp_layers",
                "head_dim", "qk_head_dim", "mlp_layer_types", "layer_types"):
        fields.pop(key, None)
    cfg = DeepseekV32Config(**fields, index_n_heads=8, index_head_dim=spec.head_dim, index_topk=8)
    return cfg, _tiny_model_class(DeepseekV32ForCausalLM)


def _tiny_model_class(base):
    """``base`` with each indexer's ``k_norm`` weight drawn around 1 and bias around 0 from the global
    RNG (which the tiny builder seeds); same class name, so ``config.architectures`` is unchanged."""
    import torch

    class DeepseekV32ForCausalLM(base):  # type: ignore[valid-type, misc]  # the transformers class, given
        def __init__(self, config):
            super().__init__(config)
            with torch.no_grad():
                for name, param in self.named_parameters():
                    if name.endswith("indexer.k_norm.weight"):
                        param.copy_(1.0 + 0.1 * torch.randn_like(param))
                    elif name.endswith("indexer.k_norm.bias"):
                        param.copy_(0.1 * torch.randn_like(param))

    DeepseekV32ForCausalLM.__qualname__ = base.__qualname__
    DeepseekV32ForCausalLM.__module__ = base.__module__
    return DeepseekV32ForCausalLM


LOCAL_SPEC_ONLY = ("sparse attention (DSA) has no Transformer Engine spec megarl can build on Megatron-Core 0.16.1 "
                   "(megarl/training/local_dsa.py)")
"""``Family.local_spec_only``: its TE form feeds the indexer the un-normed q latent and needs the CUDA
Hadamard kernel in bf16 (:mod:`megarl.training.local_dsa`)."""
WEIGHT_SYNC_REFUSAL = ("DeepSeek Sparse Attention's indexer (its wq_b / wk / k_norm rows are permuted per head on "
                       "conversion, and SGLang 0.5.23 serves the indexer with CUDA-only kernels: no CPU load proof)")
"""``Family.weight_sync_refusal``."""


FAMILY = Family(name="deepseek_v32", model_types=("deepseek_v32",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=transformer_config_kwargs, gpt_model_kwargs=v3.gpt_model_kwargs,
                megatron_shapes=megatron_shapes, engine_load_groups=v3.ENGINE_LOAD_GROUPS,
                # DeepSeek-V3.2: <think>...</think>; its DSML tool calls (SGLang's deepseekv32 detector)
                reasoning_parser="deepseek-v3", tool_call_parser="deepseekv32",
                # srt/models/deepseek_v2.py: DeepseekV32ForCausalLM(DeepseekV2ForCausalLM), `pass`;
                # DeepseekV2ForCausalLM.__init__ shares embed_tokens when tied
                engine_class="sglang.srt.models.deepseek_v2.DeepseekV32ForCausalLM", engine_unties_lm_head=False,
                tiny_config=tiny_config, tiny_random_norms=True,
                # Megatron-Core 0.16.1 wires no DSA block spec; megarl's local one (training/local_dsa.py)
                block_spec="megarl.training.local_dsa:dsa_block_spec", local_spec_only=LOCAL_SPEC_ONLY,
                weight_sync_refusal=WEIGHT_SYNC_REFUSAL)
