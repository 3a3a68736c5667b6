"""Version-guarded SGLang specifics used by weight sync (SGLang 0.5.23).

Two things live here:

- :func:`init_custom_process_group`: SGLang's helper that builds a process group outside the
  trainer's default group (the trainer side of ``/init_weights_update_group``); it moved between
  ``sglang.srt.utils`` and ``sglang.srt.utils.common`` across releases.
- :func:`cpu_presharded_qkv_fix`: the CPU-only quirk of pre-sharded loading
  (docs/architecture.md, "Running on CPU"). On CPU, SGLang's column-parallel linears (``QKVParallelLinear``,
  ``MergedColumnParallelLinear``, ``ColumnParallelLinear``) call
  ``narrow_padded_param_and_loaded_weight(param, weight, 0, tp_rank * shard, dim, shard, narrow_weight)``
  even when ``use_presharded_weights`` is set (``narrow_weight=False``). The weight is then the
  rank's own shard, so the rank offset lies past its end and the *parameter* is narrowed to 0 rows
  on every rank but 0; the layer's shape assertion then fails inside the server, which takes the
  engine down (shown by ``tests/unit/weight_sync/test_sglang_compat.py``). FusedMoE has the fix
  (``weight_start = 0`` when pre-sharded on CPU), the linears do not. While the fix is active, a
  call with ``narrow_weight=False`` is made with ``weight_start=0``: a weight that is already the
  shard starts at its own row 0. GPU code paths never call this function for pre-sharded weights.
- :func:`presharded_tp_norm_fix`: SGLang's q/k norms over all heads (MiniMax-M2's ``MiniMaxM2RMSNormTP``,
  ``models/minimax_m2.py`` lines 317-347) hold their rank's heads' slice of the weight, and their
  ``weight_loader`` cuts that slice out of whatever it gets, ``use_presharded_weights`` or not: a
  pre-sharded tensor (already the rank's heads) is cut again, which on rank > 0 fails its
  ``shard_end <= loaded_weight.shape[0]`` assertion inside the server (on CUDA as on CPU). While the
  fix is active, a tensor of the parameter's own shape is copied as it is.
"""
from __future__ import annotations

import contextlib
import threading

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
"""Releases whose loader internals the CPU fix was written against and tested with."""

_PATCH_LOCK = threading.Lock()


def sglang_version() -> str:
    """The installed SGLang version (``sglang.__version__``; imports SGLang)."""
    import sglang

    return sglang.__version__


def init_custom_process_group(**kwargs):
    """SGLang's ``init_custom_process_group`` (group with the engines; this process is rank 0)."""
    try:
        from sglang.srt.utils import init_custom_process_group as init
    except ImportError:
        from sglang.srt.utils.common import init_custom_process_group as init
    return init(**kwargs)


def cpu_quirk_applies() -> bool:
    """True where the pre-sharded CPU column-parallel quirk exists (SGLang on CPU)."""
    from sglang.srt.utils import is_cpu

    return bool(is_cpu())


@contextlib.contextmanager
def cpu_presharded_qkv_fix():
    """Load pre-sharded weights correctly on CPU (see module docstring); no-op off CPU.

    Raises:
        RuntimeError: on CPU with an SGLang release the fix was not written for (loading pre-sharded
            weights there could silently keep stale rows).
    """
    if not cpu_quirk_applies():
        yield
        return
    version = sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(f"megarl's pre-sharded CPU loading was written for SGLang {SUPPORTED_SGLANG_VERSIONS}, "
                           f"found {version}: re-check linear.py's CPU branches and update sglang_compat")
    from sglang.srt.model_loader import weight_utils

    with _PATCH_LOCK:
        original = weight_utils.narrow_padded_param_and_loaded_weight

        def narrow(param_data, loaded_weight, param_data_start, weight_start, dim, shard_size, narrow_weight=True):
            if not narrow_weight:
                weight_start = 0  # the loaded weight is already this rank's shard
            return original(param_data, loaded_weight, param_data_start, weight_start, dim, shard_size, narrow_weight)

        weight_utils.narrow_padded_param_and_loaded_weight = narrow
        try:
            yield
        finally:
            weight_utils.narrow_padded_param_and_loaded_weight = original


TP_NORM_CLASSES = ("sglang.srt.models.minimax_m2.MiniMaxM2RMSNormTP",)
"""SGLang modules (``module.qualname``) whose ``weight_loader`` slices even pre-sharded tensors."""


def tp_norms(model) -> list:
    """The modules of ``model`` that :func:`presharded_tp_norm_fix` applies to (:data:`TP_NORM_CLASSES`)."""
    return [m for m in model.modules() if f"{type(m).__module__}.{type(m).__qualname__}" in TP_NORM_CLASSES]


@contextlib.contextmanager
def presharded_tp_norm_fix(modules):
    """While active, each module's ``weight.weight_loader`` copies a tensor of the parameter's own shape
    unsliced (a pre-sharded one) and hands any other to SGLang's loader (module docstring).

    Args:
        modules: :func:`tp_norms` of the model being loaded.

    Raises:
        RuntimeError: ``modules`` is not empty and SGLang is a release the fix was not written for.
    """
    if not modules:
        yield
        return
    version = sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(f"megarl's pre-sharded loading of {TP_NORM_CLASSES} was written for SGLang "
                           f"{SUPPORTED_SGLANG_VERSIONS}, found {version}: re-check their weight_loader")
    saved = [(m.weight, m.weight.weight_loader) for m in modules]

    def loader_of(original):
        def load(param, loaded_weight):
            if tuple(loaded_weight.shape) == tuple(param.shape):
                param.data.copy_(loaded_weight)  # already this rank's heads
            else:
                original(param, loaded_weight)
        return load

    for weight, original in saved:
        weight.weight_loader = loader_of(original)
    try:
        yield
    finally:
        for weight, original in saved:
            weight.weight_loader = original
