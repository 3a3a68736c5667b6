"""A model's parameter counts from its ``config.json`` alone (no weights): the shape the planner sizes.

Counts follow Megatron-Core's layout of the families megarl trains (``qwen3_moe``, ``qwen3``,
``deepseek_v3`` with multi-latent attention, ``glm4_moe``, ``gpt_oss``; its expert and attention-sink
biases, under 0.05 % of its parameters, are not counted): per layer an attention block (GQA, or MLA
with its down-projections, which Megatron keeps whole on every tensor-parallel rank), a dense MLP
or an MoE block (router, routed experts, shared experts), RMSNorms; the embedding and, untied, an
output layer of the padded vocabulary. Multi-token-prediction layers are not built by megarl's
trainer and not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.models.families import find_family, text_config_of


def _first(hf, *names, default=None):
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


def _expert_ffn(hf) -> int:
    """One routed expert's width: ``moe_intermediate_size``, or where a config has no such field
    (gpt-oss: ``intermediate_size`` is the experts'), the family's own reading of the config."""
    width = _first(hf, "moe_intermediate_size")
    if width is None:
        family = find_family(getattr(hf, "model_type", None))
        width = family.architecture(hf).get("moe_intermediate_size", 0) if family is not None else 0
    return int(width or 0)


def _engine_unties_lm_head(model_type: str | None) -> bool:
    family = find_family(model_type)
    return family is not None and family.engine_unties_lm_head


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of one model (``config.json``), with its parameter counts."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    topk: int
    shared_ffn_hidden_size: int
    moe_layers: tuple[bool, ...]
    tie_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    """> 0: multi-latent attention (DeepSeek-V3 / Kimi-K2)."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    engine_own_lm_head: bool = False
    """The engine's SGLang class keeps ``lm_head`` apart however the checkpoint ties it (Qwen3-MoE,
    GLM-4.5: the family's :attr:`~megarl.models.families.Family.engine_unties_lm_head`)."""

    @classmethod
    def from_hf_config(cls, hf) -> ModelShape:
        """From a ``transformers`` config (either spelling of the expert fields).

        Raises:
            ValueError: a field the count needs is missing (named).
        """
        model_type = hf.model_type
        hf = text_config_of(hf)  # the language model's sizes (Kimi-K2.5 nests them under text_config)
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
            if getattr(hf, name, None) is None:
                raise ValueError(f"model.hf_path config.json: missing field {name}")
        h, layers, heads = int(hf.hidden_size), int(hf.num_hidden_layers), int(hf.num_attention_heads)
        experts = int(_first(hf, "n_routed_experts", "num_experts", "num_local_experts", default=0) or 0)
        moe_ffn = _expert_ffn(hf) if experts else 0
        shared = int(_first(hf, "shared_expert_intermediate_size", default=0) or 0)
        shared += int(_first(hf, "n_shared_experts", default=0) or 0) * moe_ffn
        return cls(
            hidden_size=h, num_layers=layers, vocab_size=int(hf.vocab_size), num_attention_heads=heads,
            num_kv_heads=int(_first(hf, "num_key_value_heads", default=heads)),
            head_dim=int(_first(hf, "head_dim", default=h // heads)),
            ffn_hidden_size=int(_first(hf, "intermediate_size", default=4 * h)),
            moe_ffn_hidden_size=moe_ffn, num_experts=experts,
            topk=int(_first(hf, "num_experts_per_tok", default=0) or 0) if experts else 0,
            shared_ffn_hidden_size=shared if experts else 0, moe_layers=_moe_layers(hf, layers, experts),
            tie_embeddings=bool(_first(hf, "tie_word_embeddings", default=False)),
            qk_norm=hf.model_type in ("qwen3", "qwen3_moe") or bool(_first(hf, "use_qk_norm", default=False)),
            attention_bias=bool(_first(hf, "attention_bias", default=False)),
            q_lora_rank=int(_first(hf, "q_lora_rank", default=0) or 0),
            kv_lora_rank=int(_first(hf, "kv_lora_rank", default=0) or 0),
            qk_nope_head_dim=int(_first(hf, "qk_nope_head_dim", default=0) or 0),
            qk_rope_head_dim=int(_first(hf, "qk_rope_head_dim", default=0) or 0),
            v_head_dim=int(_first(hf, "v_head_dim", default=0) or 0),
            engine_own_lm_head=_engine_unties_lm_head(model_type))

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3 style: ``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    def padded_vocab(self, divisible_by: int, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``."""
        unit = divisible_by * tp
        return -(-self.vocab_size // unit) * unit

    def attention_params(self) -> tuple[int, int]:
        """``(split over TP, replicated on every TP rank)`` parameters of one attention block + its norm."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q_split, q_rep = self.q_lora_rank * n * qk, h * self.q_lora_rank + self.q_lora_rank
            else:
                q_split, q_rep = h * n * qk, 0
            kv_rep = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_split = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q_split + kv_split + n * self.v_head_dim * h, q_rep + kv_rep + h
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        split = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        return split, h + (2 * self.head_dim if self.qk_norm else 0)

    def dense_mlp_params(self) -> int:
        """A gated (SwiGLU) dense MLP, all split over TP (its norm counted in the attention's replicated part)."""
        return 3 * self.hidden_size * self.ffn_hidden_size + self.hidden_size

    def moe_params(self) -> tuple[int, int, int]:
        """``(routed experts, shared experts (split over TP), router + norm (replicated))`` of one MoE layer."""
        h = self.hidden_size
        return (self.num_experts * 3 * h * self.moe_ffn_hidden_size, 3 * h * self.shared_ffn_hidden_size,
                self.num_experts * h + self.num_experts + h)

    def total_params(self, divisible_by: int = 128) -> int:
        """Every parameter of the model (the padded vocabulary at TP 1)."""
        split, rep = self.attention_params()
        experts, shared, router = self.moe_params()
        layers = sum(split + rep + (experts + shared + router if moe else self.dense_mlp_params())
                     for moe in self.moe_layers)
        vocab = self.padded_vocab(divisible_by, 1) * self.hidden_size
        return layers + vocab * (1 if self.tie_embeddings else 2) + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token passes through (top-k of the routed experts; embeddings excluded)."""
        split, rep = self.attention_params()
        experts, shared, router = self.moe_params()
        per_expert = experts // self.num_experts if self.num_experts else 0
        layers = sum(split + rep + (self.topk * per_expert + shared + router if moe else self.dense_mlp_params())
                     for moe in self.moe_layers)
        return layers + self.vocab_size * self.hidden_size  # the output layer's matmul


def _moe_layers(hf, num_layers: int, experts: int) -> tuple[bool, ...]:
    """Which layers are MoE: DeepSeek / GLM ``first_k_dense_replace``, Qwen ``mlp_only_layers`` /
    ``decoder_sparse_step``."""
    if not experts:
        return (False,) * num_layers
    first_dense = int(_first(hf, "first_k_dense_replace", default=0) or 0)
    only_mlp = set(_first(hf, "mlp_only_layers", default=()) or ())
    step = int(_first(hf, "decoder_sparse_step", default=1) or 1)
    return tuple(i >= first_dense and i not in only_mlp and (i + 1) % step == 0 for i in range(num_layers))
