"""Core attention of the local (CPU) layer spec through PyTorch's fused scaled-dot-product attention.

Megatron-Core's local ``DotProductAttention`` (0.16.1) computes ``baddbmm`` scores, fills masked
positions in place (``masked_fill_`` on a view, whose backward copies the ``[R * heads, S, S]``
scores) and runs ``softmax`` and ``bmm``: every ``[S, S]`` score of a packed row, although a packed
row is block-diagonal (each sequence attends causally to itself only). `LocalSDPAttention` is a
drop-in subclass (same constructor, parameters, state dict) that, for a block-diagonal causal mask,
calls ``torch.nn.functional.scaled_dot_product_attention`` once per sequence with
``is_causal=True``: no ``[S, S]`` mask and no scores across sequences. Any other mask goes to SDPA
as a bool mask. A learned softmax offset (gpt-oss's attention sinks) or a sliding window is
computed here per sequence in plain torch (Megatron's own path drops the packing mask for its
window mask, `LocalSDPAttention._sink_window_attention`); what neither path expresses
(attention dropout in training, an attention bias, a window or sinks with a mask that is not
block-diagonal causal) goes to ``DotProductAttention.forward`` itself.

Masked positions get ``-inf`` here and ``-10000`` in Megatron's softmax: the same probabilities for
every row that attends to at least one key (every row of a causal mask attends to itself).

The segments of a mask are found once per mask tensor (not per layer) and remembered on it;
`megarl.training.micro_batch.block_causal_mask` builds masks with their segments attached.
`use_local_sdpa_attention` puts the class into a local block spec (``megarl.training.model``); the
Transformer Engine spec is not touched.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megarl.training.micro_batch import SEGMENTS_ATTRIBUTE as _SEGMENTS


def _segments_of(mask: Tensor) -> list[list[int]] | None:
    """Per-row segment lengths if ``mask`` ([R or 1, 1, S, S] bool) is block-diagonal causal, else None."""
    known = getattr(mask, _SEGMENTS, None)
    if known is not None and known[1] == mask._version:
        return known[0]
    result = None
    if mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == mask.shape[3]:
        length = mask.shape[-1]
        # a segment starts where a position may not see the one before it
        starts = torch.diagonal(mask[:, 0], offset=-1, dim1=1, dim2=2)  # [R, S - 1]
        seq_id = torch.cat([starts.new_zeros(starts.shape[0], 1, dtype=torch.int64), starts.long().cumsum(-1)], 1)
        expected = ~((seq_id[:, :, None] == seq_id[:, None, :]) & torch.ones(length, length, dtype=torch.bool,
                                                                            device=mask.device).tril())
        if torch.equal(expected, mask[:, 0]):
            result = [torch.bincount(row).tolist() for row in seq_id.cpu()]
    setattr(mask, _SEGMENTS, (result, mask._version))  # checked once per mask, not once per layer
    return result


class LocalSDPAttention(DotProductAttention):
    """``DotProductAttention`` (Megatron-Core 0.16.1) computed by ``scaled_dot_product_attention``.

    Args: as ``DotProductAttention``.

    Forward: ``query [sq, b, np, hn]``, ``key`` / ``value [sk, b, ng, hn]`` (``ng`` query groups),
    ``attention_mask [b or 1, 1, sq, sk]`` bool (True = masked) or None (causal by
    ``attn_mask_type``); returns ``[sq, b, np * hn]``. See the module docstring for the fallbacks.
    """

    def _sdpa_supported(self, attention_bias, packed_seq_params) -> bool:
        dropout = self.training and self.attention_dropout.p > 0
        return (attention_bias is None and packed_seq_params is None and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None and not dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        """Attention of one layer (shapes in the class docstring): ``[sq, b, np * hn]``.

        Sinks or a sliding window on a causal or packed-causal mask take the per-sequence sink/window
        path; an attention bias, THD packed-sequence params, attention dropout in training, or sinks /
        a window on any other mask take Megatron's own ``DotProductAttention.forward``; the rest runs
        ``scaled_dot_product_attention``.
        """
        sinks_or_window = self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None
        if sinks_or_window and attention_bias is None and packed_seq_params is None and not (
                self.training and self.attention_dropout.p > 0):
            segments = _segments_of(attention_mask) if attention_mask is not None else None
            if segments is None and attention_mask is None and query.shape[0] == key.shape[0] and (
                    attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                segments = [[query.shape[0]]]
            if segments is not None:
                return self._sink_window_attention(query, key, value, segments)
        if not self._sdpa_supported(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        # Megatron divides its scale by the layer number under apply_query_key_layer_scaling and
        # multiplies the scores by it again in the softmax
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        gqa = query.shape[2] != key.shape[2]
        segments = _segments_of(attention_mask) if attention_mask is not None else None
        if attention_mask is not None and segments is None:
            if attention_mask.dtype != torch.bool or (~attention_mask).any(-1).logical_not().any():
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=scale, enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
        if segments is None:  # no mask: one causal sequence per row (Megatron's default causal mask)
            if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal or query.shape[0] != key.shape[0]:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
            segments = [[query.shape[0]]]

        def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)  # [n, np, hn]

        return _per_segment(query, key, value, segments, causal)

    def _sink_window_attention(self, query: Tensor, key: Tensor, value: Tensor, segments: list[list[int]]) -> Tensor:
        """Causal attention per packed sequence with a learned sink per head (``softmax_offset``:
        one more logit in each row's softmax, its probability dropped) and a sliding window
        (``window_size`` ``(left, right)``: key j is seen from query i when
        ``i - left <= j <= i + right``, and j <= i), scores in fp32. Megatron's own path replaces
        the given mask by its sliding-window mask (``megatron/core/fusions/fused_softmax.py``
        line 321, ``forward_torch_softmax``), so sequences packed in one row would see each other
        (the tiny gpt-oss's packed logits were 0.18 off transformers' that way). Shapes as
        :meth:`forward`; returns ``[sq, b, np * hn]``."""
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        window = self.scale_mask_softmax.window_size
        repeat = query.shape[2] // key.shape[2]

        def sink_window(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            n = q.shape[0]
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, hn]
            k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
            scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale  # [np, n, n]
            i = torch.arange(n, device=q.device)
            seen = i[None, :] <= i[:, None]
            if window is not None:
                seen &= (i[None, :] >= i[:, None] - window[0]) & (i[None, :] <= i[:, None] + window[1])
            scores = scores.masked_fill(~seen, float("-inf"))
            if self.softmax_offset is not None:
                sink = self.softmax_offset.float().view(-1, 1, 1).expand(-1, n, 1)
                scores = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :n].to(v.dtype)
            return torch.matmul(probs, v).transpose(0, 1)  # [n, np, hn]

        return _per_segment(query, key, value, segments, sink_window)


def _per_segment(query: Tensor, key: Tensor, value: Tensor, segments: list[list[int]],
                 attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """Run ``attend`` on each packed sequence of each row and put the rows back together.

    Args:
        query: ``[sq, b, np, hn]``; key, value: ``[sk, b, ng, hn]``.
        segments: per row, the lengths of the sequences packed in it (one list for every row when
            the mask was broadcast over the rows).
        attend: ``(q [n, np, hn], k [n, ng, hn], v [n, ng, hn]) -> [n, np, hn]`` for one sequence.

    Returns:
        ``[sq, b, np * hn]``.
    """
    if len(segments) == 1 and query.shape[1] > 1:  # a mask broadcast over the rows
        segments = segments * query.shape[1]
    rows = []
    for r, lens in enumerate(segments):
        pieces, start = [], 0
        for n in lens:
            pieces.append(attend(*(t[start:start + n, r] for t in (query, key, value))))
            start += n
        rows.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    context = torch.stack(rows, dim=1)  # [sq, b, np, hn]
    return context.reshape(context.shape[0], context.shape[1], -1)


def use_local_sdpa_attention(block_spec) -> int:
    """Swap Megatron's local ``DotProductAttention`` for `LocalSDPAttention` in every layer spec
    of ``block_spec`` (a ``TransformerBlockSubmodules``), in place.

    Returns:
        The number of layer specs changed (MLA layers and Transformer Engine specs are left alone).
    """
    changed = 0
    for layer_spec in block_spec.layer_specs:
        attention = getattr(layer_spec.submodules, "self_attention", None)
        if getattr(attention, "module", None) is not SelfAttention:  # MLA keeps its own (local_mla.py)
            continue
        submodules = attention.submodules  # type: ignore[union-attr]  # SelfAttention's spec
        if getattr(submodules, "core_attention", None) is DotProductAttention:
            submodules.core_attention = LocalSDPAttention
            changed += 1
    return changed
