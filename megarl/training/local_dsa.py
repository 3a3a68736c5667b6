"""DeepSeek Sparse Attention for the local (CPU) layer spec: DeepSeek-V3.2's indexer and sparse MLA.

Megatron-Core 0.16.1 has the modules (``transformer/experimental_attention_variant/dsa.py``:
``DSAttention``, ``DSAIndexer``) but no block spec that builds them on this stack:
``get_experimental_attention_variant_module_spec`` raises ``Invalid experimental attention variant:
dsa`` (``models/gpt/experimental_attention_variant_module_specs.py`` line 142, it knows only
``gated_delta_net``), ``get_dsa_module_spec_for_backend`` calls ``backend.linear()``, which the local
backend (``models/backends.py`` ``LocalSpecProvider``) lacks, and its Transformer Engine form fuses
``q_a_layernorm`` into ``linear_q_up_proj`` (``q_layernorm=IdentityOp``) so the indexer would get the
q latent before its norm (DeepSeek's reference and transformers give it the normed one). At run
time ``DSAIndexer`` applies ``rotate_activation``, which asserts bf16 and the CUDA-only
``fast_hadamard_transform`` (``dsa.py`` lines 30-47), and ``DSAttention`` ignores the attention mask
under MLA's causal ``attn_mask_type`` (line 766), so sequences packed in one row would see each other.

Here, subclasses keep Megatron's parameters, names and layout:

- :class:`LocalDSAIndexer`: ``DSAIndexer.forward_with_scores`` without the Hadamard rotation (an
  orthogonal map of q and k: every q . k is unchanged; transformers' ``DeepseekV32Indexer`` skips it
  too), with Megatron's own ``_apply_rope`` and ``_compute_index_scores``; its projections are
  :class:`DuplicatedLinear` (the replicated ``Linear`` the local backend lacks), its key norm the
  local ``WrappedTorchNorm`` LayerNorm.
- :class:`LocalDSAttention`: ``DSAttention`` that scores and attends under the given mask (packed
  rows: block-diagonal causal), and, with ``dsa_indexer_loss_coeff`` 0 (megarl's setting), freezes
  the indexer (its only gradient is that loss) and skips the loss.

:func:`use_local_dsa_attention` puts them into a block spec.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
    compute_dsa_indexer_loss,
    unfused_dsa_fn,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from torch import Tensor


class DuplicatedLinear(torch.nn.Module):
    """A bias-free linear layer replicated on every TP rank (Transformer Engine's ``TELinear`` with
    ``parallel_mode="duplicated"``, which ``DSAIndexer`` builds): ``weight [output_size, input_size]``.

    Constructor as Megatron's linear layers (keyword ``config``, ``init_method``, ``bias``, ...);
    forward ``x [..., input_size]`` -> ``(x W^T [..., output_size], None)``.

    Raises:
        ValueError: ``bias=True`` or a ``parallel_mode`` other than ``duplicated``.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: str = "duplicated", **_):
        super().__init__()
        if bias or parallel_mode != "duplicated" or skip_weight_param_allocation:
            raise ValueError(f"DuplicatedLinear: bias={bias}, parallel_mode={parallel_mode!r}, "
                             f"skip_weight_param_allocation={skip_weight_param_allocation}: only a replicated "
                             "weight without bias")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        """``(x W^T, None)``."""
        return F.linear(x, self.weight), None


class LocalDSAIndexer(DSAIndexer):
    """Megatron-Core 0.16.1's ``DSAIndexer`` without the bf16 / CUDA Hadamard rotation.

    ``forward_with_scores(x [s / sp, b, hidden], qr [s / sp, b, q_lora_rank], mask [b or 1, s, s]
    fp32 (0 / -inf) or None)`` -> ``(index_scores [b, s, s] fp32, topk_indices [b, s, min(topk, s)])``:
    ``score[s, t] = sum_h relu(q[s, h] . k[t]) w[s, h] / sqrt(heads * head_dim)`` plus the mask.
    """

    def forward_with_scores(self, x: Tensor, qr: Tensor, mask: Tensor | None = None,
                            packed_seq_params=None) -> tuple[Tensor, Tensor]:
        """Index scores and top-k key indices (shapes in the class docstring).

        Raises:
            NotImplementedError: THD ``packed_seq_params`` (as Megatron's).
        """
        if packed_seq_params is not None:
            raise NotImplementedError("LocalDSAIndexer: THD packed_seq_params are not supported (as Megatron's)")
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        seqlen, bsz, _ = x.shape
        rotary = self.rotary_pos_emb(seqlen, packed_seq=False)
        rotary, mscale = (rotary, 1.0) if self.config.rope_type == "rope" else rotary
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(seqlen, bsz, self.index_n_heads, self.index_head_dim), rotary, mscale)
        k, _ = self.linear_wk(x)
        # the key norm in its weight's dtype (a LayerNorm refuses bf16 input against fp32 weights), cast back
        k = self.k_norm(k.to(self.k_norm.weight.dtype)).to(k.dtype)
        k = self._apply_rope(k.reshape(seqlen, bsz, 1, self.index_head_dim), rotary, mscale)
        weights, _ = self.linear_weights_proj(x)
        weights = weights * (self.index_n_heads ** -0.5) * self.softmax_scale
        index_scores = self._compute_index_scores(q, weights, k.reshape(seqlen, bsz, self.index_head_dim))
        if mask is not None:
            index_scores = index_scores + mask
        return index_scores, index_scores.topk(min(self.index_topk, seqlen), dim=-1)[1]


class LocalDSAttention(DSAttention):
    """Megatron-Core 0.16.1's ``DSAttention`` under the given attention mask.

    Forward: ``query [sq, b, np / tp, hn]``, ``key [sk, b, np / tp, hn]``, ``value [sk, b, np / tp,
    hnv]``, ``attention_mask [b or 1, 1, sq, sk]`` bool (True = masked; packed rows) or None (causal),
    ``x`` (the layer input) and ``qr`` (the normed q latent) as ``DSAttention``; returns
    ``[sq, b, np / tp * hnv]``. A top-k key the mask hides (a query that sees fewer than ``index_topk``
    keys) is replaced by the query's own position, so Megatron's ``unfused_dsa_fn`` (causal mask +
    top-k mask) attends exactly to the visible selected keys.
    """

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number: int, attn_mask_type,
                 attention_type: str, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type, attention_type, **kwargs)
        self.indexer_loss_coeff = float(config.dsa_indexer_loss_coeff or 0.0)
        if not self.indexer_loss_coeff:  # its only gradient is the KL loss: keep it as released
            for param in self.indexer.parameters():
                param.requires_grad_(False)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, x: Tensor,
                qr: Tensor, attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        """Sparse attention of one layer (shapes in the class docstring).

        Raises:
            NotImplementedError: an attention bias or THD ``packed_seq_params``; the indexer loss
                (``dsa_indexer_loss_coeff`` > 0) with packed rows (Megatron's loss is causal only).
        """
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("LocalDSAttention: no attention bias or THD packed_seq_params")
        sq, b = query.shape[:2]
        sk = key.shape[0]
        if attention_mask is None:
            float_mask = torch.full((sq, sk), float("-inf"), device=query.device).triu(1).unsqueeze(0)
        else:
            float_mask = torch.zeros(attention_mask.shape[0], sq, sk, device=query.device).masked_fill(
                attention_mask[:, 0], float("-inf"))
        index_scores, topk = self.indexer.forward_with_scores(x.detach(), qr.detach(), mask=float_mask)
        hidden = torch.gather(float_mask.expand(b, -1, -1), -1, topk).isinf()
        own = torch.arange(sq, device=topk.device).view(1, sq, 1).expand_as(topk)
        output = unfused_dsa_fn(query, key, value, torch.where(hidden, own, topk), self.softmax_scale)
        if self.indexer_loss_coeff and self.training and torch.is_grad_enabled():
            if attention_mask is not None:
                raise NotImplementedError("model.megatron_overrides.dsa_indexer_loss_coeff > 0 with packed rows: "
                                          "Megatron-Core 0.16.1's indexer loss masks causally only")
            loss = compute_dsa_indexer_loss(index_scores, topk, query.detach(), key.detach(), self.softmax_scale,
                                            self.indexer_loss_coeff, self.config.dsa_indexer_use_sparse_loss,
                                            self.indexer.pg_collection)
            output = _attach_loss(output, loss)
        return output


def _attach_loss(output: Tensor, loss: Tensor) -> Tensor:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    return DSAIndexerLossAutoScaler.apply(output, loss)


def dsa_core_attention_spec() -> ModuleSpec:
    """The local spec of an MLA layer's ``core_attention`` under DSA."""
    indexer = ModuleSpec(module=LocalDSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=WrappedTorchNorm,
        linear_weights_proj=DuplicatedLinear))
    return ModuleSpec(module=LocalDSAttention, submodules=DSAttentionSubmodules(indexer=indexer))


def use_local_dsa_attention(block_spec) -> int:
    """Make every MLA layer of a local ``block_spec`` (``TransformerBlockSubmodules``) sparse: its
    ``core_attention`` becomes :func:`dsa_core_attention_spec`, in place.

    Returns:
        The number of layer specs changed.
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    changed = 0
    for layer_spec in block_spec.layer_specs:
        attention = layer_spec.submodules.self_attention
        if getattr(attention, "module", None) is MLASelfAttention:
            attention.submodules.core_attention = dsa_core_attention_spec()
            changed += 1
    return changed


def dsa_block_spec(config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """DeepSeek-V3.2's ``Family.block_spec``: Megatron-Core's local GPT block spec (RMSNorm) with every
    MLA layer made sparse (:func:`use_local_dsa_attention`). ``pp_rank`` None: this rank's.

    Raises:
        ValueError: ``use_te`` (the family is ``local_spec_only``: the trainer never asks for it).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if use_te:
        raise ValueError("DeepSeek Sparse Attention has no Transformer Engine block spec in megarl (local only)")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    use_local_dsa_attention(block)
    return block
