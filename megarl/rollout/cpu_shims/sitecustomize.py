"""Post-import fix for SGLang 0.5.23's routed-expert capture on CPU (server process only).

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one; megarl's
engine launcher puts this directory on ``PYTHONPATH`` of the SGLang server when ``device == "cpu"``,
so the server and every process it spawns (scheduler, detokenizer) run this file. Nothing else does.

Why: with ``--enable-return-routed-experts`` SGLang's capture buffer (``state_capturer/base.py``,
``BaseHostCache``) allocates host memory through ``ALLOC_MEMORY_FUNCS[device]`` from
``sglang.srt.mem_cache.pool_host.common``. For ``"cpu"`` that table falls back to
``alloc_with_host_register``, which pins the buffer with ``torch.cuda.cudart().cudaHostRegister``
and crashes the scheduler on a CPU-only torch.

Fix: once that module has been imported, map ``"cpu"`` to SGLang's own ``alloc_with_pin_memory``
with pinning off (a plain host tensor). SGLang's sources are not edited; the table entry is only set
when the running SGLang is the version this was written for (0.5.23) and the table is present.

The same import hook applies ``sglang_mla_dispatch.py`` of this directory (its own docstring says why):
a ``torch_native`` attention handler for SGLang's MLA models (DeepSeek-V3, Kimi-K2); and
``sglang_sink_attention.py``: gpt-oss (attention sinks, sliding window) on ``torch_native``; and
``sglang_gdn_ops.py``: Qwen3.5's gated-DeltaNet / gated-attention CPU kernels in plain torch; and
``sglang_minimax_qk_norm.py``: MiniMax-M2's q/k norm over all heads without its CUDA-only Triton kernels.

Other ``sitecustomize`` modules further down ``sys.path`` are still executed, so this file does not
hide a site's own customisation.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys

_SUPPORTED_SGLANG = "0.5.23"
_TARGET_MODULE = "sglang.srt.mem_cache.pool_host.common"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def plain_host_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``ALLOC_MEMORY_FUNCS`` entry for ``"cpu"``: an unpinned host tensor (pinning needs CUDA)."""
    from sglang.srt.mem_cache.pool_host.common import alloc_with_pin_memory

    return alloc_with_pin_memory(dims, dtype, "cpu", False, None)


def patch_alloc_table(module) -> bool:
    """Point ``module.ALLOC_MEMORY_FUNCS["cpu"]`` at :func:`plain_host_alloc`; True if patched."""
    table = getattr(module, "ALLOC_MEMORY_FUNCS", None)
    if table is None or not hasattr(module, "alloc_with_pin_memory"):
        print(f"[megarl cpu_shims] {_TARGET_MODULE} has no ALLOC_MEMORY_FUNCS/alloc_with_pin_memory; "
              "routed-expert capture fix NOT applied", file=sys.stderr)
        return False
    table["cpu"] = plain_host_alloc
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds each module of ``patches`` / ``before`` with the normal path finder and runs its patch
    after (``patches``) or right before (``before``) the module executes."""

    def __init__(self, patches: dict, before: dict | None = None) -> None:
        self.patches = patches  # module name -> function(module) run right after the module executes
        self.before = before or {}  # module name -> function(module) run right before it executes

    def find_spec(self, fullname, path, target=None):
        patch, pre = self.patches.get(fullname), self.before.get(fullname)
        if patch is None and pre is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            if pre is not None:
                pre(module)
            original_exec(module)
            if patch is not None:
                patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    version = _sglang_version()
    if version is None:
        return
    if version != _SUPPORTED_SGLANG:
        print(f"[megarl cpu_shims] sglang {version} is not {_SUPPORTED_SGLANG}; routed-expert capture "
              "fix NOT applied (re-check whether it is still needed)", file=sys.stderr)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        import sglang_gdn_ops
        import sglang_minimax_qk_norm
        import sglang_mla_dispatch  # this directory is on the server's sys.path
        import sglang_sink_attention

        sys.meta_path.insert(0, _PatchOnImport({
            _TARGET_MODULE: patch_alloc_table,
            sglang_mla_dispatch.TARGET_MODULE: sglang_mla_dispatch.patch_mla_dispatch,
            **sglang_sink_attention.PATCHES, **sglang_gdn_ops.PATCHES, **sglang_minimax_qk_norm.PATCHES},
            before=sglang_gdn_ops.PRE_PATCHES))


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows, if any (the first one after our directory)."""
    later = [p for p in sys.path if p and os.path.abspath(p) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
_chain_next_sitecustomize()
