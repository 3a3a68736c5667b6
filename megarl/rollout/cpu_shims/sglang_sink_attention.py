"""SGLang 0.5.23 gpt-oss (attention sinks + sliding window) on the ``torch_native`` backend (CPU server only).

Loaded by ``sitecustomize.py`` of this directory, so only into a CPU SGLang server and the processes it
spawns; the import name is the file name (this directory is on the server's ``PYTHONPATH``).

Why, two refusals in SGLang 0.5.23:

1. ``handle_model_specific_adjustments`` (``sglang/srt/arg_groups/model_hook.py``, the
   ``GptOssForCausalLM`` branch, lines 515-543) asserts that the attention backend is one of
   ``triton, trtllm_mha, fa3, fa4, ascend, intel_amx, intel_xpu, aiter``, "torch_native has neither
   sliding window nor attention sinks". On a CPU the only listed one is ``intel_amx``, which needs an
   AMX CPU and the ``sgl_kernel`` CPU build (``arg_groups/model_overrides/gpt_oss.py`` picks it only
   when ``get_platform().has_amx``); this machine has neither. The server stops before it loads.
2. ``GptOssAttention.forward_core`` (``sglang/srt/models/gpt_oss.py``) calls its ``RadixAttention``
   with ``sinks=self.sinks``; ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode``
   (``layers/attention/torch_native_backend.py``) take no ``sinks`` argument (a ``TypeError`` at the
   first request), and they read a sliding-window layer's keys from the SWA sub-pool of the hybrid
   ``SWAKVPool`` with the *full* pool's indices (``req_to_token``) instead of translating them
   (``SWAKVPool.translate_loc_from_full_to_swa``), which SGLang's other backends do.

Fix: (1) while SGLang checks a ``GptOssForCausalLM`` config whose backend is ``torch_native`` on
``device == "cpu"``, the check sees ``triton`` (one of its list) in place of ``torch_native``: nothing
else of that step reads the backend. (2) ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode``
take ``sinks``; a call with sinks is computed by :func:`sink_attention` (transformers' eager gpt-oss
attention, ``transformers/models/gpt_oss/modeling_gpt_oss.py`` ``eager_attention_forward``, over the
KV cache, sliding-window keys read through the SWA index translation); a call without sinks goes to
SGLang's own method unchanged. SGLang's sources are not edited; nothing is patched unless the running
SGLang is :data:`SUPPORTED_SGLANG`.

Deviation kept from SGLang: ``GptOssAttention`` stores the sinks in bfloat16 on every backend but
``trtllm_mha`` (``models/gpt_oss.py``, ``sinks_dtype``), so a float32 server rounds them to bf16 at
load time; :func:`sink_attention` upcasts them to the query's dtype. The released checkpoints store
them in bf16 already; the tiny float32 test model's logprobs stay within the serving tolerance.
"""
from __future__ import annotations

import sys

SUPPORTED_SGLANG = "0.5.23"
MODEL_HOOK_MODULE = "sglang.srt.arg_groups.model_hook"
BACKEND_MODULE = "sglang.srt.layers.attention.torch_native_backend"
ARCH = "GptOssForCausalLM"
STAND_IN = "triton"
"""What the gpt-oss backend check of ``model_hook.py`` is shown in place of ``torch_native``."""


def sink_attention(query, key, value, sinks, scaling: float, window: int = -1, query_offset: int = 0):
    """Causal attention with a learned sink logit per head and an optional sliding window.

    ``out[h, i] = sum_j p[h, i, j] v[g(h), j]`` with ``p[h, i, :] = softmax([s[h, i, j] for visible j]
    + [sinks[h]])`` minus the sink's column: the sink takes probability mass and gives no value
    (transformers' ``eager_attention_forward`` of gpt-oss, which also subtracts the row maximum).
    ``s = scaling * q . k``; query ``i`` sits at position ``query_offset + i``; key ``j`` is visible
    when ``j <= pos(i)`` and, for ``window >= 0``, ``j >= pos(i) - window`` (SGLang's
    ``sliding_window_size``, which gpt-oss sets to the HF ``sliding_window - 1``). Query head ``h``
    reads KV head ``h // (Hq / Hkv)`` (transformers' ``repeat_kv``).

    Args:
        query: ``[Hq, Lq, D]``.
        key: ``[Hkv, Lk, D]``; ``value``: ``[Hkv, Lk, Dv]``.
        sinks: ``[Hq]`` sink logits (any float dtype; used in the query's dtype).
        scaling: softmax scale (``head_dim ** -0.5``).
        window: ``-1`` for full causal attention, else the number of earlier keys a query still sees.
        query_offset: position of the first query among the keys (``Lk - Lq`` for a prefill over a
            cached prefix or a decode step).

    Returns:
        ``[Hq, Lq, Dv]`` in the query's dtype.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, or ``sinks`` not ``[Hq]``.
    """
    import torch

    heads, q_len, kv_heads, kv_len = query.shape[0], query.shape[1], key.shape[0], key.shape[1]
    if heads % kv_heads or tuple(sinks.shape) != (heads,):
        raise ValueError(f"sink_attention: query heads {heads}, kv heads {kv_heads}, sinks {tuple(sinks.shape)}")
    key = key.to(query.dtype).repeat_interleave(heads // kv_heads, dim=0)
    value = value.to(query.dtype).repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.matmul(query, key.transpose(1, 2)) * scaling
    q_pos = torch.arange(query_offset, query_offset + q_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=query.device).unsqueeze(0)
    visible = k_pos <= q_pos
    if window >= 0:
        visible = visible & (k_pos >= q_pos - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink_col = sinks.to(query.dtype).reshape(heads, 1, 1).expand(heads, q_len, 1)
    logits = torch.cat([scores, sink_col], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, value)


def _cache_indices(backend, layer, tokens):
    """KV-cache rows of ``tokens`` (full-pool indices) for ``layer``: translated into the SWA
    sub-pool for a sliding-window layer of a hybrid ``SWAKVPool``."""
    pool = backend.token_to_kv_pool
    if backend.use_sliding_window_kv_pool and pool.layers_mapping[layer.layer_id][1]:
        return pool.translate_loc_from_full_to_swa(tokens)
    return tokens


def forward_with_sinks(backend, q, k, v, layer, forward_batch, save_kv_cache: bool, sinks, decode: bool):
    """``TorchNativeAttnBackend.forward_extend`` / ``forward_decode`` with sinks: store ``k``/``v``,
    then :func:`sink_attention` per request over its cached keys (prefix + this step's tokens).

    Args:
        q: ``[T, Hq * D]`` (or ``[T, Hq, D]``) for the ``T`` tokens of this step.
        k, v: ``[T, Hkv, D]`` new keys/values, or None when already stored.
        layer: the ``RadixAttention`` (``layer_id``, heads, ``scaling``, ``sliding_window_size``).
        forward_batch: SGLang's ``ForwardBatch`` (``seq_lens``, ``req_pool_indices``, ``extend_seq_lens``).
        decode: one query token per request (a decode step) instead of ``extend_seq_lens``.

    Returns:
        ``[T, Hq * Dv]``.
    """
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    heads = layer.tp_q_head_num
    q_ = q.reshape(-1, heads, layer.qk_head_dim)
    out = q_.new_empty((q_.shape[0], heads, layer.v_head_dim))
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    window = layer.sliding_window_size if (layer.sliding_window_size or -1) > -1 else -1
    kv_lens = forward_batch.seq_lens.tolist()
    q_lens = [1] * len(kv_lens) if decode else forward_batch.extend_seq_lens.tolist()
    start = 0
    for i, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens)):
        tokens = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[i], :kv_len]
        rows = _cache_indices(backend, layer, tokens)
        keys, values = k_cache[rows].transpose(0, 1), v_cache[rows].transpose(0, 1)
        res = sink_attention(q_[start:start + q_len].transpose(0, 1), keys, values, sinks, layer.scaling,
                             window, kv_len - q_len)
        out[start:start + q_len] = res.transpose(0, 1)
        start += q_len
    return out.reshape(-1, heads * layer.v_head_dim)


def patch_torch_native(module) -> bool:
    """Give ``module.TorchNativeAttnBackend`` a ``sinks`` argument on ``forward_extend`` /
    ``forward_decode`` (:func:`forward_with_sinks`); calls without sinks reach SGLang's methods.

    Returns:
        True if patched; False (with a line on stderr) if the class or its methods are missing.
    """
    cls = getattr(module, "TorchNativeAttnBackend", None)
    if cls is None or not all(hasattr(cls, m) for m in ("forward_extend", "forward_decode")):
        print(f"[megarl cpu_shims] {BACKEND_MODULE} has no TorchNativeAttnBackend.forward_extend/decode; "
              "attention-sink fix NOT applied", file=sys.stderr)
        return False
    if getattr(cls.forward_extend, "_megarl_sinks", False):
        return True
    original_extend, original_decode = cls.forward_extend, cls.forward_decode

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if sinks is None:
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return forward_with_sinks(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, decode=False)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if sinks is None:
            return original_decode(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return forward_with_sinks(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, decode=True)

    forward_extend._megarl_sinks = forward_decode._megarl_sinks = True  # type: ignore[attr-defined]
    cls.forward_extend, cls.forward_decode = forward_extend, forward_decode
    return True


def _gpt_oss_on_cpu_torch_native(module, server_args) -> bool:
    """The server being checked runs gpt-oss on ``device == "cpu"`` with ``torch_native`` attention."""
    if getattr(server_args, "device", None) != "cpu":
        return False
    if set(module.attention_backends_of(module.resolved_view(server_args))) != {"torch_native"}:
        return False
    if module.parse_connector_type(server_args.model_path) == module.ConnectorType.INSTANCE:
        return False  # no hf_config (SGLang's step returns early too)
    hf_config = module.model_config_of(server_args).hf_config
    return (getattr(hf_config, "architectures", None) or [None])[0] == ARCH


def patch_backend_check(module) -> bool:
    """Wrap ``module.handle_model_specific_adjustments`` so that its gpt-oss backend check accepts
    ``torch_native`` on a CPU server (module docstring, refusal 1).

    Returns:
        True if patched; False (with a line on stderr) if the step or its helpers are missing.
    """
    names = ("handle_model_specific_adjustments", "attention_backends_of", "model_config_of", "resolved_view",
             "parse_connector_type", "ConnectorType")
    if not all(hasattr(module, n) for n in names):
        print(f"[megarl cpu_shims] {MODEL_HOOK_MODULE} lacks one of {names}; gpt-oss torch_native "
              "check NOT relaxed", file=sys.stderr)
        return False
    original_step, original_backends_of = module.handle_model_specific_adjustments, module.attention_backends_of

    def handle_model_specific_adjustments(server_args):
        if not _gpt_oss_on_cpu_torch_native(module, server_args):
            return original_step(server_args)
        module.attention_backends_of = lambda cfg: tuple(
            STAND_IN if b == "torch_native" else b for b in original_backends_of(cfg))
        try:
            return original_step(server_args)
        finally:
            module.attention_backends_of = original_backends_of

    module.handle_model_specific_adjustments = handle_model_specific_adjustments
    return True


PATCHES = {MODEL_HOOK_MODULE: patch_backend_check, BACKEND_MODULE: patch_torch_native}
"""Module name -> patch run right after that module is imported (by ``sitecustomize``)."""
