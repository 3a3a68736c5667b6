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
