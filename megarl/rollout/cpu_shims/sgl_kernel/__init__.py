"""Import-only stand-in for ``sgl_kernel`` in the SGLang *server* process on CPU (SGLang 0.5.23).

Why: with ``SGLANG_USE_CPU_ENGINE=1`` about 80 SGLang modules execute ``from sgl_kernel import ...``
at import time, but no CPU build of ``sgl_kernel`` exists on PyPI (the ``sgl-kernel`` /
``sglang-kernel`` wheels are CUDA-only; SGLang's CPU build is compiled from its git repository for
Intel AMX Xeons). On a CPU without that build SGLang serves through its torch-native layers and calls
none of these kernels, so only the *names* have to import.

What it does: any attribute resolves to a function that raises ``NotImplementedError`` naming the
kernel when called, so an unexpected kernel call fails loudly instead of computing something wrong.
It registers no ``torch.ops.sgl_kernel`` operators, so SGLang's AMX detection
(``_is_intel_amx_backend_available``: ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``)
stays False even on an AMX machine and the torch-native path is taken there too.

Scope: only on ``PYTHONPATH`` of the server process when ``device == "cpu"`` (see
:mod:`megarl.rollout.cpu_shims`); the trainer and the client never import it. Set
``MEGARL_SGL_KERNEL_SHIM_LOG=/path`` to log every name SGLang asks for (one line per lookup).

Guard: written against sglang 0.5.23; :func:`megarl.rollout.cpu_shims.check_sglang_version` refuses
other versions before the server is launched. Remove when a CPU ``sgl_kernel`` wheel is installable.
"""
from __future__ import annotations

import os as _os

__version__ = "0.0.0+megarl.cpu_shim"
MEGARL_CPU_SHIM = True
"""Marker: tells a test (and a curious user) that this is the megarl shim, not the real library."""


def _log(line: str) -> None:
    path = _os.environ.get("MEGARL_SGL_KERNEL_SHIM_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{line} pid={_os.getpid()}\n")


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        _log(f"called {name}")
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this process runs megarl's import-only CPU shim of "
            "sgl_kernel (no CPU build of sgl_kernel is installed). SGLang chose a kernel path this "
            "CPU setup does not support; see megarl/rollout/cpu_shims/__init__.py.")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    # Dunder lookups (``__path__``, ``__wrapped__``, ...) must fail normally, or importlib and
    # inspect would treat the module as something it is not.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    _log(f"getattr {name}")
    return _unavailable(name)
