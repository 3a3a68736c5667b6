"""Import-only stand-in for ``torchvision`` in the SGLang *server* process on CPU (SGLang 0.5.23).

Why: SGLang 0.5.23 imports ``torchvision.transforms`` at server start even for text-only models
(``sglang.srt.configs`` -> ``nano_nemotron_vl`` -> ``multimodal.internvl_utils``, and
``configs.deepseek_ocr``). The only torchvision wheel that matches torch 2.13 is CUDA-linked and
breaks ``import transformers.image_utils`` on CPU torch, so megarl's CPU install leaves torchvision
out (tools/install.sh). Text-only serving never calls a torchvision function.

What it does: every ``torchvision.*`` module imports; every attribute is a placeholder that can be
read further (``InterpolationMode.BICUBIC``, ``T.Compose``) and compared, but raises
``NotImplementedError`` when called. So a vision model fails loudly at its first image instead of
at import, and a text model never notices. There is no ``torchvision`` distribution metadata, so
``importlib.metadata.version("torchvision")`` still fails.

Scope and guard: as for the ``sgl_kernel`` shim beside it (server process, ``device == "cpu"``,
sglang 0.5.23 only). Remove when a CPU torchvision wheel for the pinned torch is installable.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+megarl.cpu_shim"
MEGARL_CPU_SHIM = True


class _Placeholder:
    """A name from the absent torchvision: attribute reads give more placeholders, calls raise."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} was called, but this SGLang server runs megarl's import-only CPU shim "
            "of torchvision (vision models are not supported by the CPU setup).")

    def __mro_entries__(self, bases):
        # ``class X(torchvision.transforms.Compose)`` at import time: derive from object instead.
        return (object,)

    def __repr__(self) -> str:
        return f"<megarl torchvision shim {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any ``torchvision.<sub>`` module on demand as a placeholder module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr(__name__)
sys.meta_path.append(_SubmoduleFinder())
