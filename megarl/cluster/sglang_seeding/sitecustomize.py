"""Per-request seeded sampling for the SGLang 0.5.23 server on CPU (server processes only).

Why: a resumed run must sample exactly what an uninterrupted one would (``rollout.deterministic_sampling``),
so every generate call carries a ``sampling_seed`` (see :class:`megarl.launch.rollout_actor.SeededEngine`).
SGLang honours ``sampling_seed`` only under ``--enable-deterministic-inference``, which 0.5.23 refuses
with the ``torch_native`` attention backend (the only one on CPU) and which would also install
Triton batch-invariant kernels. Its seeded sampler itself (``multinomial_with_seed``: Gumbel noise
from a hash of seed, position and token id) is plain torch and runs on CPU.

Fix, two patches applied when their modules are imported (active only with
``MEGARL_SEEDED_SAMPLING=1`` and sglang 0.5.23; SGLang's sources are not edited):

1. ``sglang.srt.sampling.sampling_batch_info``: ``SamplingBatchInfo.from_schedule_batch`` gives
   every batch a ``sampling_seed`` tensor (the request's seed; a random one for a request without)
   when deterministic inference is off. Every batch has one, so SGLang's filter/merge code keeps
   the rows aligned.
2. ``sglang.srt.layers.sampler``: ``multinomial_with_seed`` hashes (seed, position, token id) with
   a Triton kernel, or on CPU with a ``sgl_kernel`` op that has no CPU build on PyPI. It is replaced
   by :func:`multinomial_with_seed`, the same Gumbel-max sampler with MurmurHash3 written in torch
   integer ops.

How it gets there: :mod:`megarl.cluster.ray_engines` appends this directory to ``PYTHONPATH`` of the
engine actor; the engine's own CPU shims (``megarl/rollout/cpu_shims/sitecustomize.py``, earlier on
the path) run the next ``sitecustomize`` on the path, i.e. this one, which in turn runs the next.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys

ENV_FLAG = "MEGARL_SEEDED_SAMPLING"
_SUPPORTED_SGLANG = "0.5.23"
_BATCH_INFO_MODULE = "sglang.srt.sampling.sampling_batch_info"
_SAMPLER_MODULE = "sglang.srt.layers.sampler"
_M32 = 0xFFFFFFFF
_HERE = os.path.dirname(os.path.abspath(__file__))


def seeds_for(reqs, device):
    """``[B]`` int64 seeds of the requests (a fresh random seed where a request has none)."""
    import torch

    seeds = [r.sampling_params.sampling_seed if r.sampling_params.sampling_seed is not None
             else int(torch.randint(0, 2**62, ()).item()) for r in reqs]
    return torch.tensor(seeds, dtype=torch.int64, device=device)


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h, k):
    k = (k * 0xCC9E2D51) & _M32  # int64 products wrap, their low 32 bits are exact
    k = (_rotl32(k, 15) * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32(seed, positions, col_indices):
    """``[n, m]`` MurmurHash3 (32 bit) of (seed low, seed high, position, column), as SGLang's kernel."""
    import torch

    seed = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(seed)
    h = _murmur3_mix(h, seed & _M32)
    h = _murmur3_mix(h, (seed >> 32) & _M32)
    h = _murmur3_mix(h, positions.to(torch.int64).view(-1, 1) & _M32)
    h = _murmur3_mix(h, col_indices.to(torch.int64).view(1, -1) & _M32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def multinomial_with_seed(logprobs, seed, positions):
    """``[n, 1]`` indices sampled from ``[n, m]`` logprobs with Gumbel noise from the hash above."""
    import torch

    n, m = logprobs.shape
    hashed = murmur_hash32(seed, positions, torch.arange(m, device=logprobs.device))
    x = hashed.to(torch.float64) / _M32
    x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0**-32)).neg_()
    x.log_().neg_()  # -log(-log(u)): Gumbel noise
    x.add_(logprobs.to(torch.float64))
    return torch.argmax(x, dim=1, keepdim=True)


def patch_batch_info(module) -> bool:
    """Wrap ``module.SamplingBatchInfo.from_schedule_batch``; True if patched."""
    cls = getattr(module, "SamplingBatchInfo", None)
    original = getattr(cls, "from_schedule_batch", None)
    if original is None or getattr(original, "_megarl_seeded", False):
        return False
    original_fn = original.__func__

    def from_schedule_batch(klass, batch, vocab_size):
        info = original_fn(klass, batch, vocab_size)
        if info.sampling_seed is None:
            info.sampling_seed = seeds_for(batch.reqs, info.temperatures.device)
        return info

    from_schedule_batch._megarl_seeded = True
    cls.from_schedule_batch = classmethod(from_schedule_batch)
    return True


def patch_sampler(module) -> bool:
    """Point ``module.multinomial_with_seed`` at the torch implementation; True if patched."""
    if not hasattr(module, "multinomial_with_seed"):
        return False
    module.multinomial_with_seed = multinomial_with_seed
    return True


_PATCHES = {_BATCH_INFO_MODULE: patch_batch_info, _SAMPLER_MODULE: patch_sampler}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            if not _PATCHES[fullname](module):
                print(f"[megarl seeded sampling] {fullname}: patch target not found; "
                      "sampling_seed NOT honoured", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    if os.environ.get(ENV_FLAG) != "1":
        return
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return
    if version != _SUPPORTED_SGLANG:
        print(f"[megarl seeded sampling] sglang {version} is not {_SUPPORTED_SGLANG}; not applied",
              file=sys.stderr)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _chain_next_sitecustomize() -> None:
    """Run the next ``sitecustomize`` on the path (a site's own), as the CPU shims do."""
    mine = [i for i, p in enumerate(sys.path) if p and os.path.abspath(p) == _HERE]
    later = [p for p in sys.path[(mine[-1] + 1 if mine else 0):] if p]  # only what comes after us
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
_chain_next_sitecustomize()
