"""Multi-latent attention on Megatron-Core's local (non-Transformer-Engine) spec.

Megatron-Core 0.16.1's ``get_gpt_layer_local_spec(multi_latent_attention=True)`` pairs
``MLASelfAttention`` with the local ``DotProductAttention``, whose constructor lacks the
``k_channels`` / ``v_channels`` arguments MLA passes (query/key head dim ``qk_head_dim +
qk_pos_emb_head_dim`` differs from the value head dim), so building fails with
``TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``
(NVIDIA/Megatron-LM issue #1589; fix proposed upstream in PR #6564). Its forward already handles
different q/k and v head dims except for the output width, which it takes from ``kv_channels``.
:class:`LocalMLADotProductAttention` accepts both arguments and sizes the output by
``v_channels``; :func:`use_local_mla_attention` puts it into a block spec. Both are no-ops once the
installed Megatron-Core accepts ``k_channels`` (checked on the signature, not the version).

Without Transformer Engine, ``megatron.core.extensions.transformer_engine`` still imports (its TE
classes become ``MagicMock`` objects), so ``multi_latent_attention`` sets ``HAVE_TE = True`` and its
constructor calls ``isinstance(linear_proj, TELinear)`` with a mock: ``TypeError: isinstance() arg 2
must be a type``. :func:`fix_mla_te_detection` sets that module's ``HAVE_TE`` to the extension's own
(false) flag; :func:`use_local_mla_attention` applies it.
"""
from __future__ import annotations

import inspect
import math

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide


def local_attention_accepts_mla() -> bool:
    """True when the installed local ``DotProductAttention`` takes MLA's ``k_channels``."""
    return "k_channels" in inspect.signature(DotProductAttention.__init__).parameters


class LocalMLADotProductAttention(DotProductAttention):
    """Local ``DotProductAttention`` with MLA's per-head query/key and value sizes.

    Args:
        k_channels: query/key head dim (MLA: ``qk_head_dim + qk_pos_emb_head_dim``); sets the
            default softmax scale ``1/sqrt(k_channels)`` (MLA passes its own YaRN-scaled one).
        v_channels: value head dim; the output is ``[s, b, num_heads/tp * v_channels]``.
        Others: as ``DotProductAttention`` (Megatron-Core 0.16.1).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            tp_size = self.pg_collection.tp.size()
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp_size)


def fix_mla_te_detection() -> bool:
    """Make ``multi_latent_attention.HAVE_TE`` false when Transformer Engine is absent.

    Returns:
        True if the flag was wrong and has been corrected (process-global, idempotent).
    """
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.transformer.multi_latent_attention as mla

    if mla.HAVE_TE and not te_extension.HAVE_TE:
        mla.HAVE_TE = False
        return True
    return False


def use_local_mla_attention(block_spec) -> None:
    """Swap the local ``DotProductAttention`` of every MLA layer spec in ``block_spec`` (a
    ``TransformerBlockSubmodules``) for :class:`LocalMLADotProductAttention`, in place, and apply
    :func:`fix_mla_te_detection`."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    fix_mla_te_detection()
    if local_attention_accepts_mla():
        return
    for layer_spec in block_spec.layer_specs:
        attention = layer_spec.submodules.self_attention
        if attention.module is MLASelfAttention and attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = LocalMLADotProductAttention
