"""``sgl_kernel.mamba`` of megarl's CPU shim: the three functions SGLang 0.5.23 imports from it for
Qwen3.5's gated DeltaNet on CPU (``srt/layers/attention/linear/gdn_backend.py`` lines 183-187,
``srt/layers/attention/linear/kernels/gdn_triton.py`` line 28), in plain torch, from
``sglang_gdn_ops.py`` of the shim directory (its docstring says why and how). Any other name resolves
to a function that raises ``NotImplementedError`` when called, as in ``sgl_kernel`` itself.
"""
from __future__ import annotations

from sglang_gdn_ops import causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu

from . import _unavailable

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"]


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _unavailable(f"mamba.{name}")
