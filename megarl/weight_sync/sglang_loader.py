"""Custom SGLang weight loader for pre-sharded, HF-named tensors (the ``shard`` transport).

Registered at engine launch with ``--custom-weight-loader megarl.weight_sync.sglang_loader.load_presharded``
and named in ``/update_weights_from_tensor``'s ``load_format``. SGLang 0.5.23 hands each TP rank
only its own payload (``serialized_named_tensors[tp_rank]``) and calls this function on that rank
with it. The tensors keep their checkpoint names (``model.layers.0.self_attn.q_proj.weight``) but
hold only the rank's slice; turning on the layers' own ``use_presharded_weights`` switch (column /
row / QKV / merged linears, vocab-parallel embedding and LM head, FusedMoE) makes SGLang's
``model.load_weights`` skip its per-rank narrowing while still doing the fusing (q/k/v -> qkv_proj,
gate/up -> w13) and padding. Experts of other EP ranks are never sent. MiniMax-M2's q/k norms,
which have no such switch, get one while loading (``sglang_compat.presharded_tp_norm_fix``).

This runs inside the server: an exception here takes the engine down, which is why the trainer
validates names, shapes and dtypes before sending (:mod:`megarl.weight_sync.manifest_checks`).

Measurement: with ``MEGARL_WEIGHT_SYNC_STATS_DIR`` set in the server's environment, each call
appends ``{"tp_rank", "bytes_received", "num_tensors", "param_bytes"}`` to
``rank{tp_rank}.jsonl`` there (``param_bytes``: the bytes of this rank's model parameters, the
shard it holds).
"""
from __future__ import annotations

import json
import logging
import os
import weakref

log = logging.getLogger(__name__)

CUSTOM_WEIGHT_LOADERS = ["megarl.weight_sync.sglang_loader.load_presharded",
                         "megarl.weight_sync.receiver.receive_shards"]
"""What an engine that may receive ``shard`` or ``p2p`` updates passes to ``--custom-weight-loader``."""
STATS_DIR_ENV = "MEGARL_WEIGHT_SYNC_STATS_DIR"
_PRESHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (its modules with a ``use_presharded_weights`` switch, its q/k norms over all heads:
``sglang_compat.tp_norms``)."""


def load_presharded(model, named_tensors) -> None:
    """Load this rank's pre-sharded HF tensors into ``model`` (SGLang custom-loader signature).

    Args:
        model: the rank's SGLang model (``nn.Module`` with ``load_weights``).
        named_tensors: ``[(hf_name, tensor), ...]``: this rank's slices.
    """
    from megarl.weight_sync.sglang_compat import cpu_presharded_qkv_fix, presharded_tp_norm_fix, tp_norms

    cached = _PRESHARDED.get(model)
    if cached is None:  # walking the module tree costs ~1 ms per call on a small model: once per model
        cached = _PRESHARDED[model] = ([m for m in model.modules() if hasattr(m, "use_presharded_weights")],
                                       tp_norms(model))
    modules, norms = cached
    loaded = served(named_tensors)
    toggled = [(m, m.use_presharded_weights) for m in modules]
    for module, _ in toggled:
        module.use_presharded_weights = True
    try:
        with cpu_presharded_qkv_fix(), presharded_tp_norm_fix(norms):
            model.load_weights(loaded)
    finally:
        for module, flag in toggled:
            module.use_presharded_weights = flag
    _record(model, named_tensors)


def served(named_tensors) -> list:
    """``named_tensors`` as this engine loads them: block-FP8 slices dequantised where it serves the
    dequantised view of a block-FP8 checkpoint (CPU, :func:`megarl.rollout.dequantized_view.served_tensors`),
    else unchanged (an already dequantised list passes through: it has no FP8 tensor)."""
    from sglang.srt.runtime_context import get_server_args

    from megarl.rollout.dequantized_view import served_tensors

    try:
        path = get_server_args().model_path
    except ValueError:  # "Global server args is not set yet!": outside a server (a test calling the loader)
        return list(named_tensors)
    return served_tensors(path, named_tensors)


def _record(model, named_tensors) -> None:
    directory = os.environ.get(STATS_DIR_ENV)
    if not directory:
        return
    from sglang.srt.runtime_context import get_parallel

    rank = get_parallel().tp_rank
    row = {"tp_rank": rank, "num_tensors": len(named_tensors),
           "bytes_received": sum(t.numel() * t.element_size() for _, t in named_tensors),
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
