"""Compatibility shims for running the real SGLang 0.5.23 server on a CPU-only machine.

This directory is put on ``PYTHONPATH`` of the SGLang *server* process (and so of the scheduler and
detokenizer processes it spawns) by :class:`megarl.rollout.engine_process.EngineProcess` when
``device == "cpu"``, and nowhere else: the trainer, the client and the tests never import them. On
GPU no shim is used. Background: ``docs/architecture.md`` ("Running on CPU").

Shims (each documented in its own file, each shown still needed by
``tests/integration/rollout/test_engine_cpu_shims.py``):

- ``sgl_kernel/``: import-only ``sgl_kernel``. SGLang's CPU path imports ~80 names from it at import
  time; no CPU build exists on PyPI; with the torch-native backends none is called. Calling one
  raises ``NotImplementedError``.
- ``torchvision/``: import-only ``torchvision``. SGLang 0.5.23 imports ``torchvision.transforms`` at
  server start even for text models; the only wheel for torch 2.13 is CUDA-linked, so megarl's CPU
  install omits torchvision. Calling anything raises ``NotImplementedError``.
- ``sitecustomize.py``: maps SGLang's host allocator for ``"cpu"`` to an unpinned allocation so that
  ``--enable-return-routed-experts`` (Rollout Routing Replay) does not call CUDA.
- ``sglang_mla_dispatch.py`` (applied by ``sitecustomize``): a ``torch_native`` attention handler for
  MLA models (DeepSeek-V3, Kimi-K2) that keeps prefill on SGLang's absorbed-MLA path; its MHA path
  attends over the latent cache on this backend and fails (``tests/integration/rollout/test_engine_mla_cpu.py``).
- ``sglang_sink_attention.py`` (applied by ``sitecustomize``): gpt-oss on ``torch_native``. SGLang
  refuses that backend for ``GptOssForCausalLM`` at start-up and the backend has no attention sinks;
  the shim lets the check pass on CPU and computes sink + sliding-window attention as transformers'
  eager gpt-oss attention (``tests/unit/rollout/test_sink_attention_shim.py``,
  ``tests/integration/rollout/test_engine_gpt_oss_cpu.py``).
- ``sglang_gdn_ops.py`` (applied by ``sitecustomize``; ``sgl_kernel/mamba.py`` re-exports three of its
  functions): Qwen3.5's CPU kernels in plain torch. SGLang takes the gated-DeltaNet conv / delta rule /
  gates and the gated attention's fused q/k norm and output gate from the ``sgl_kernel`` CPU build at
  import time (``layers/attention/linear/gdn_backend.py`` lines 183-188, ``models/qwen3_5.py`` lines
  283-298), so ``Qwen3_5MoeForCausalLM`` does not load without them (``tests/unit/rollout/test_gdn_ops_shim.py``,
  ``tests/integration/rollout/test_engine_qwen3_5_cpu.py``).
- ``sglang_minimax_qk_norm.py`` (applied by ``sitecustomize``): MiniMax-M2's q/k norm over all heads.
  Without AMX, SGLang's ``MiniMaxM2QKRMSNorm`` runs two Triton kernels that assert CUDA tensors
  (``models/minimax_m2.py`` lines 205, 252); the shim computes CPU tensors in plain torch
  (``tests/unit/rollout/test_minimax_qk_norm_shim.py``, ``tests/integration/weight_sync/test_load_proof.py``).

Guard: :func:`check_sglang_version` is called by the launcher before a CPU server starts; the shims
were written against, and are only applied to, :data:`SUPPORTED_SGLANG_VERSION`.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

SUPPORTED_SGLANG_VERSION = "0.5.23"
"""The SGLang version these shims were written and tested for."""

SHIM_NAMES = ("sgl_kernel", "torchvision", "sitecustomize", "sglang_mla_dispatch", "sglang_sink_attention",
              "sglang_gdn_ops", "sglang_minimax_qk_norm")
"""What the shim directory provides, by import name."""

ALLOW_OTHER_VERSION_ENV = "MEGARL_ALLOW_UNTESTED_SGLANG"
"""Set to 1 to launch a CPU server with another SGLang version anyway (at your own risk)."""


def shim_dir() -> Path:
    """The directory to prepend to the server's ``PYTHONPATH`` (this package's directory)."""
    return Path(__file__).resolve().parent


def check_sglang_version() -> str:
    """Return the installed SGLang version; refuse one the shims were not written for.

    Raises:
        RuntimeError: SGLang is not installed, or its version is not :data:`SUPPORTED_SGLANG_VERSION`
            and ``MEGARL_ALLOW_UNTESTED_SGLANG=1`` is not set.
    """
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError("sglang is not installed; run tools/install.sh") from exc
    if version != SUPPORTED_SGLANG_VERSION and os.environ.get(ALLOW_OTHER_VERSION_ENV) != "1":
        raise RuntimeError(
            f"megarl's CPU shims for SGLang were written for sglang {SUPPORTED_SGLANG_VERSION}, found "
            f"{version}. Re-check each shim in {shim_dir()} (run tests/integration/rollout/"
            f"test_engine_cpu_shims.py), then update SUPPORTED_SGLANG_VERSION, or set "
            f"{ALLOW_OTHER_VERSION_ENV}=1 to try anyway.")
    return version


def apply_to_env(env: dict[str, str]) -> dict[str, str]:
    """Return a copy of a server environment with the CPU shims and SGLang's CPU switch applied.

    Prepends :func:`shim_dir` to ``PYTHONPATH`` and sets ``SGLANG_USE_CPU_ENGINE=1``.
    """
    out = dict(env)
    parts = [str(shim_dir())] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join(parts)
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    return out
