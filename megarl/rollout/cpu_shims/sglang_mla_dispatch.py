"""SGLang 0.5.23 MLA (DeepSeek-V2/V3, Kimi-K2) on the ``torch_native`` attention backend (CPU server only).

Loaded by ``sitecustomize.py`` of this directory, so only into a CPU SGLang server and the processes it
spawns; the import name is the file name (this directory is on the server's ``PYTHONPATH``).

Why: ``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` (``sglang/srt/models/deepseek_v2.py``) asks
``AttentionBackendRegistry`` (``models/deepseek_common/attention_backend_handler.py``) for the
handler of the running backend. ``torch_native`` has none, so the ``triton`` handler answers, and it
picks the MHA method for a prefill without cached prefix. That method (``forward_mha.py``,
``forward_normal_core``) passes the decompressed per-head ``k``/``v`` to the attention with
``save_kv_cache=False`` and expects the backend to attend over them; ``TorchNativeAttnBackend``
(``layers/attention/torch_native_backend.py``, ``_run_sdpa_forward_extend``) always attends over the
KV *cache* instead, which for MLA holds the compressed latent (``kv_lora_rank + qk_rope_head_dim``
per token). The first prefill then fails in ``scaled_dot_product_attention``: "Expected size for
first two dimensions of batch2 tensor to be: [heads, qk_nope + qk_rope] but got: [heads,
kv_lora_rank + qk_rope]". No choice of tiny head sizes makes that path right: with equal sizes it
would attend over the latent as if it were the keys.

Fix: register a ``torch_native`` handler that returns SGLang's own absorbed-MLA method (the one its
``triton`` handler already picks for decode and for prefill with a cached prefix). That path writes the
latent into the cache and attends over it with the absorbed ``q`` (``kv_lora_rank + qk_rope_head_dim``)
and ``v`` (``kv_lora_rank``), which the torch-native backend handles. It is the same attention
(weight absorption is exact algebra); SGLang's sources are not edited, and nothing is registered when
SGLang already has a ``torch_native`` handler or is not :data:`SUPPORTED_SGLANG`.
"""
from __future__ import annotations

import sys

SUPPORTED_SGLANG = "0.5.23"
TARGET_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
BACKEND = "torch_native"


def handle_attention_torch_native(attn, forward_batch):
    """``AttentionBackendRegistry`` handler for ``torch_native``: always the absorbed MLA method.

    Args:
        attn: the ``DeepseekV2AttentionMLA`` layer asking.
        forward_batch: SGLang's ``ForwardBatch`` (prefill or decode).

    Returns:
        ``AttnForwardMethod.MLA`` (or the CPU-AMX variant SGLang itself would pick for this layer).
    """
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def patch_mla_dispatch(module) -> bool:
    """Register :func:`handle_attention_torch_native` in ``module.AttentionBackendRegistry``.

    Args:
        module: the imported :data:`TARGET_MODULE`.

    Returns:
        True if registered; False (with a line on stderr) if the registry is missing or already has
        a ``torch_native`` handler of SGLang's own.
    """
    registry = getattr(module, "AttentionBackendRegistry", None)
    if registry is None or not hasattr(module, "_dispatch_mla_subtype"):
        print(f"[megarl cpu_shims] {TARGET_MODULE} has no AttentionBackendRegistry/_dispatch_mla_subtype; "
              "MLA torch_native fix NOT applied", file=sys.stderr)
        return False
    current = registry._handlers.get(BACKEND)
    if current is not None and current is not handle_attention_torch_native:
        print(f"[megarl cpu_shims] SGLang has its own {BACKEND} MLA handler; MLA fix NOT applied",
              file=sys.stderr)
        return False
    registry.register(BACKEND, handle_attention_torch_native)
    return True
