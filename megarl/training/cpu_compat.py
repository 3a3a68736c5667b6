"""Megatron-Core 0.16.1 on a machine without CUDA: the named compatibility patches.

Megatron-Core assumes CUDA in a handful of places that matter for a CPU/gloo run (tests, CI,
laptops). Each assumption is patched by one named function below; ``apply_cpu_patches()`` applies
them, only when CUDA is absent and only on the megatron-core version they were written for (every
patch is shown necessary by ``tests/unit/training/test_cpu_compat.py``, which disables it and
asserts the documented failure; re-run that test after upgrading megatron-core).

=====================  ======================================================================
name                   what breaks without it
=====================  ======================================================================
rng                    the tensor-parallel RNG tracker calls ``torch.cuda.get_rng_state``
current_device         ``torch.cuda.current_device()`` (rotary embedding, DDP buffers, p2p)
moe_te_gemm            0.16.1 bug: ``NameError: te_general_gemm`` in the router without TE
cuda_device_args       hard-coded ``device="cuda"`` / ``.cuda()`` (schedules, causal mask, optimizer)
tensor_type_names      optimizer checks ``param.type() == 'torch.cuda.FloatTensor'``
cuda_sync              pipeline p2p calls ``torch.cuda.synchronize()``
cuda_stream            the alltoall token dispatcher creates ``torch.cuda.Stream()``
moe_splits_numpy       alltoall split sizes stay tensors on CPU; ``all_to_all_single`` rejects them
torchnorm_sp           the local spec's torch norm refuses ``sequence_parallel`` (needed by MoE+TP)
expert_bias_inplace    biased experts (gpt-oss) at expert TP 1: ``MLP.forward`` adds the bias in place
                       to a row-parallel output that Megatron's TP-1 reduce returned as-is
=====================  ======================================================================

Scope: the patches are process-global (``cuda_device_args`` replaces what
an earlier version used: ``cuda_device_mode``, a per-thread ``TorchFunctionMode`` that costs a
Python call on every torch operation).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable

import torch

SUPPORTED_MCORE_VERSION = "0.16.1"
"""The megatron-core release these patches were written and tested for."""

_APPLIED: set[str] = set()
_LOCK = threading.Lock()


def patch_rng() -> None:
    """Route Megatron's CUDA RNG tracker to the CPU default generator.

    ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add/fork`` get/set the CUDA
    generator state. On CPU the CPU generator plays its role: ``torch.cuda.manual_seed(s)`` seeds
    it, so each tracker state (data-, model-, expert-parallel) is a distinct seeded CPU state.
    """
    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


def patch_current_device() -> None:
    """Make ``torch.cuda.current_device()`` return ``"cpu"`` (used as a ``device=`` argument)."""
    torch.cuda.current_device = lambda: "cpu"


def patch_moe_te_gemm() -> None:
    """Define ``moe_utils.te_general_gemm = None`` (0.16.1 leaves it undefined without TE)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


_DEVICE_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye",
                     "rand", "randn", "randint", "randperm", "empty_like", "zeros_like", "ones_like",
                     "full_like", "rand_like", "randn_like", "empty_strided")


def _wrap_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    factory.__wrapped__, factory.__name__, factory.__doc__ = fn, getattr(fn, "__name__", "factory"), fn.__doc__
    factory._megarl_cpu_patch = True
    return factory


def patch_cuda_device_args() -> None:
    """Map CUDA ``device=`` arguments of torch's tensor factories, ``Tensor.to`` and ``Tensor.cuda``
    to the CPU.

    Megatron hard-codes ``device="cuda"`` in the schedules (token counters), the default causal
    mask, the optimizer (scales, overflow buffers), gradient clipping and DDP buffers. Wrapping the
    factories costs one Python call per factory call (a ``TorchFunctionMode`` would intercept every
    torch operation).

    ``with torch.device(...)`` recognises constructors by identity through a cached set; that
    cache is filled with the original functions before they are wrapped.
    """
    from torch.utils._device import _device_constructors

    _device_constructors()  # cache the originals (see above)
    for name in _DEVICE_FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "_megarl_cpu_patch", False):
            setattr(torch, name, _wrap_factory(fn))
    original_to = torch.Tensor.to
    if getattr(original_to, "_megarl_cpu_patch", False):
        return

    def to(self, *args, **kwargs):
        if args:
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        return self

    to._megarl_cpu_patch = True
    torch.Tensor.to = to
    torch.Tensor.cuda = cuda


def patch_tensor_type_names() -> None:
    """Report CPU tensors under CUDA type names in ``Tensor.type()`` without arguments.

    Megatron's optimizers accept only ``'torch.cuda.{Float,Half,BFloat16}Tensor'`` parameters.
    """
    original = torch.Tensor.type
    if getattr(original, "_megarl_cpu_patch", False):
        return

    def _type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    _type._megarl_cpu_patch = True
    torch.Tensor.type = _type


def patch_cuda_sync() -> None:
    """Make ``torch.cuda.synchronize()`` a no-op (called by pipeline p2p after batched ops)."""
    torch.cuda.synchronize = lambda *a, **k: None


class _NoStream:
    """Stand-in for ``torch.cuda.Stream``/``Event`` on CPU: every operation completes at once."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def elapsed_time(self, other):
        return 0.0


def patch_cuda_stream() -> None:
    """Replace ``torch.cuda`` streams and events with completed no-ops.

    The alltoall dispatcher builds a device-to-host side stream at construction and synchronises
    on its events; on CPU the copies are synchronous already.
    """
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def patch_moe_splits_numpy() -> None:
    """Make ``maybe_move_tensor_to_cpu(as_numpy=True)`` return numpy for CPU tensors too.

    Upstream converts only CUDA tensors; the alltoall dispatcher then passes tensors as split
    sizes to ``all_to_all_single``, which accepts only lists of ints (or numpy arrays).
    """
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_megarl_cpu_patch", False):
        return

    def _move(tensor, as_numpy=False, record_stream=False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    _move._megarl_cpu_patch = True
    moe_utils.maybe_move_tensor_to_cpu = _move
    token_dispatcher.maybe_move_tensor_to_cpu = _move


def patch_torchnorm_sp() -> None:
    """Let the local spec's ``WrappedTorchNorm`` run under sequence parallelism.

    MoE with TP > 1 requires ``sequence_parallel``, which the torch norm refuses (TE/apex norms
    accept it). The norm is built from a copy of the config without it, and its parameters are
    tagged ``sequence_parallel=True`` (as TE/apex do) so ``finalize_model_grads`` all-reduces their
    gradients over the tensor-parallel group.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_megarl_cpu_patch", False):
        return

    def _new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = dataclasses.replace(config, sequence_parallel=False)
        norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    _new._megarl_cpu_patch = True
    WrappedTorchNorm.__new__ = _new


def patch_expert_bias_inplace() -> None:
    """Make the local ``RowParallelLinear``'s reduce over a 1-rank group the plain identity.

    ``_reduce`` returns its input itself at group size 1 (``tensor_parallel/mappings.py:26-28``), so
    ``_ReduceFromModelParallelRegion`` returns an input as-is and autograd marks the output a view
    of a custom Function's input; ``MLP.forward`` of a biased expert then adds ``output_bias *
    per_token_scale`` to it in place (``transformer/mlp.py:244-247``), which autograd forbids
    (``RuntimeError: ... is a view and is being modified inplace``): gpt-oss cannot train on the
    local spec at expert TP 1. The identity without the Function is the same forward and backward.
    """
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.mappings import get_tensor_model_parallel_group_if_none

    original = layers.reduce_from_tensor_model_parallel_region
    if getattr(original, "_megarl_cpu_patch", False):
        return

    def reduce(input_, group=None):
        if get_tensor_model_parallel_group_if_none(group).size() == 1:
            return input_
        return original(input_, group)

    reduce._megarl_cpu_patch = True
    layers.reduce_from_tensor_model_parallel_region = reduce


PATCHES: dict[str, Callable[[], None]] = {
    "rng": patch_rng,
    "current_device": patch_current_device,
    "moe_te_gemm": patch_moe_te_gemm,
    "cuda_device_args": patch_cuda_device_args,
    "tensor_type_names": patch_tensor_type_names,
    "cuda_sync": patch_cuda_sync,
    "cuda_stream": patch_cuda_stream,
    "moe_splits_numpy": patch_moe_splits_numpy,
    "torchnorm_sp": patch_torchnorm_sp,
    "expert_bias_inplace": patch_expert_bias_inplace,
}
"""Every patch by name, in application order."""


def check_megatron_version() -> str:
    """Return the installed megatron-core version.

    Raises:
        RuntimeError: it is not :data:`SUPPORTED_MCORE_VERSION`.
    """
    from importlib.metadata import version

    installed = version("megatron-core")
    if installed != SUPPORTED_MCORE_VERSION:
        raise RuntimeError(
            f"megarl.training.cpu_compat: the CPU patches were written for megatron-core "
            f"{SUPPORTED_MCORE_VERSION}, but {installed} is installed. Re-verify each patch with "
            f"tests/unit/training/test_cpu_compat.py and update SUPPORTED_MCORE_VERSION.")
    return installed


def apply_cpu_patches(names: Iterable[str] | None = None, *, force: bool = False) -> tuple[str, ...]:
    """Apply the CPU patches (all, or the named ones) when CUDA is absent.

    Idempotent: a patch already applied is skipped.

    Args:
        names: patch names from :data:`PATCHES`; None = all of them.
        force: apply even when CUDA is available (tests only).

    Returns:
        The names applied or already active, in application order; empty when CUDA is available.

    Raises:
        RuntimeError: the installed megatron-core is not the supported version.
        KeyError: an unknown patch name.
    """
    if torch.cuda.is_available() and not force:
        return ()
    wanted = list(PATCHES) if names is None else list(names)
    unknown = [n for n in wanted if n not in PATCHES]
    if unknown:
        raise KeyError(f"unknown CPU patch(es) {unknown}; known: {list(PATCHES)}")
    check_megatron_version()
    with _LOCK:
        for name in PATCHES:
            if name not in wanted:
                continue
            if name not in _APPLIED:
                PATCHES[name]()
                _APPLIED.add(name)
    return tuple(n for n in PATCHES if n in _APPLIED)
