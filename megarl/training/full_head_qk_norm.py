"""Query / key RMSNorm over all heads of a token together (MiniMax-M2), for both layer specs.

MiniMax-M2 normalises each token's whole query ``[num_attention_heads * head_dim]`` and whole key
``[num_key_value_heads * head_dim]`` with one RMS each (transformers 5.19
``MiniMaxM2Attention``: ``q_norm = RMSNorm(num_attention_heads * head_dim)`` applied to
``q_proj(x)`` before the heads are split). Megatron-Core 0.16.1 has only the per-head norm: its
``SelfAttention`` builds ``q_layernorm`` / ``k_layernorm`` with ``hidden_size =
hidden_size_per_attention_head`` (``transformer/attention.py`` lines 1280-1298) and applies them to
``[sq, b, heads, head_dim]``; no ``TransformerConfig`` field widens them. :class:`FullHeadRMSNorm`
is put in their place (:func:`use_full_head_qk_norm`); its parameter keeps Megatron's name
(``self_attention.q_layernorm.weight``), so checkpoints, the mapping table and weight sync see an
ordinary norm weight.

Under tensor parallelism a rank holds ``heads / tp`` query heads (and ``groups / tp`` key heads, or one
key group shared by ``tp / groups`` ranks). The sum of squares is all-reduced over the TP group and
divided by ``tp x`` the local width, which is the mean over all heads in both cases (a key group
held by ``r`` ranks is counted ``r`` times in the sum and in the divisor); SGLang 0.5.23 does the same
(``srt/models/minimax_m2.py`` ``MiniMaxM2RMSNormTP.forward``). The all-reduce's backward is an
all-reduce (Megatron's ``reduce_from_tensor_model_parallel_region`` after
``copy_to_tensor_model_parallel_region``), since each rank's heads use the shared RMS.

The weight is kept whole, ``[heads * head_dim]``, on every TP rank (replicated, like Megatron's
per-head q/k norms), and a rank multiplies by its own heads' slice. Its gradient is then nonzero
only on that slice, and Megatron's ``finalize_model_grads`` sums q/k norm gradients over the TP group
whenever ``qk_layernorm`` is set (``distributed/finalize_model_grads.py`` line 355), which assembles
the whole gradient on every rank: the replicas stay equal, and a dist checkpoint stores it once.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as mps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

HEAD_KINDS = ("query", "key")


class FullHeadRMSNorm(torch.nn.Module):
    """``y = w_r * (x / sqrt(mean(x^2 over every head of the token) + eps))``, the mean taken over the
    TP group, ``w_r`` this rank's heads' slice of the whole weight; computed in fp32, cast back before
    the gain as transformers' ``MiniMaxM2RMSNorm``.

    Args:
        config: the ``TransformerConfig`` (``num_attention_heads``, ``num_query_groups``, ``params_dtype``).
        hidden_size: one head's width (what ``SelfAttention`` passes: ``kv_channels``).
        eps: added to the mean square.
        heads: ``"query"`` (``num_attention_heads`` heads) or ``"key"`` (``num_query_groups`` heads).

    Raises:
        ValueError: ``heads`` is neither; the heads do not divide over TP (nor TP over them, for keys).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, heads: str):
        super().__init__()
        if heads not in HEAD_KINDS:
            raise ValueError(f"heads: expected one of {HEAD_KINDS}, got {heads!r}")
        total = config.num_attention_heads if heads == "query" else config.num_query_groups
        self.tp_size = mps.get_tensor_model_parallel_world_size()
        tp_rank = mps.get_tensor_model_parallel_rank()
        if total % self.tp_size == 0:
            local, first = total // self.tp_size, tp_rank * (total // self.tp_size)
        elif heads == "key" and self.tp_size % total == 0:  # one key group, shared by tp / total ranks
            local, first = 1, tp_rank // (self.tp_size // total)
        else:
            raise ValueError(f"{heads} heads ({total}) do not divide over tensor_model_parallel_size={self.tp_size}")
        self.eps = eps
        self.local_slice = slice(first * hidden_size, (first + local) * hidden_size)
        self.weight = torch.nn.Parameter(torch.ones(total * hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``x [sq, b, local heads, head_dim]`` -> same shape and dtype."""
        flat = x.reshape(*x.shape[:-2], -1).float()
        sum_sq = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            sum_sq = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(sum_sq))
        normed = flat * torch.rsqrt(sum_sq / (self.tp_size * flat.shape[-1]) + self.eps)
        return (self.weight[self.local_slice] * normed.to(x.dtype)).view(x.shape)


def use_full_head_qk_norm(block_spec) -> int:
    """Put :class:`FullHeadRMSNorm` as ``q_layernorm`` / ``k_layernorm`` in every ``SelfAttention`` layer
    spec of ``block_spec`` (a ``TransformerBlockSubmodules``, local or Transformer Engine), in place.

    Returns:
        The number of layer specs changed.
    """
    changed = 0
    for layer_spec in block_spec.layer_specs:
        attention = getattr(layer_spec.submodules, "self_attention", None)
        if getattr(attention, "module", None) is not SelfAttention:
            continue
        submodules = attention.submodules  # type: ignore[union-attr]  # SelfAttention's spec
        submodules.q_layernorm = ModuleSpec(module=FullHeadRMSNorm, params={"heads": "query"})
        submodules.k_layernorm = ModuleSpec(module=FullHeadRMSNorm, params={"heads": "key"})
        changed += 1
    return changed


def full_head_qk_norm_block_spec(config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """MiniMax-M2's ``Family.block_spec``: Megatron-Core's GPT block spec (RMSNorm; Transformer Engine's
    with ``use_te``) with :func:`use_full_head_qk_norm` applied. ``pp_rank`` None: this rank's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    use_full_head_qk_norm(block)
    return block
