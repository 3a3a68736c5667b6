"""The weights a run's trainer starts from, handed to `megarl.training.trainer_build.build_trainer`.

The trainer builds randomly initialised model chunks; the loader returned here fills them in place,
on every rank, before DDP and the optimizer copy the parameters::

    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))

``model.load_dir`` (a Megatron dist checkpoint, :mod:`megarl.conversion.load_dir`) wins over the HF
weights of ``model.hf_path`` (``model.load_weights``, :func:`megarl.conversion.load_hf.load_hf_weights`).
"""
from __future__ import annotations

import functools

from megarl.training.trainer_build import WeightLoader


def initial_weights(model_cfg) -> WeightLoader | None:
    """The loader of the weights ``model_cfg`` (the ``model`` config section) starts training from.

    Returns:
        ``model.load_dir``'s loader when set, else the HF loader of ``model.hf_path`` when
        ``model.load_weights``, else None (training starts from the random initialisation).
    """
    load_dir = model_cfg.load_dir
    if load_dir:
        return functools.partial(_load_megatron, load_dir=load_dir)
    if model_cfg.load_weights:
        return functools.partial(_load_hf, hf_dir=model_cfg.hf_path)
    return None


def _load_megatron(model_chunks: list, parallel, *, load_dir) -> int:
    """`megarl.conversion.load_dir.load_megatron_weights` (each rank reads its own regions)."""
    from megarl.conversion.load_dir import load_megatron_weights

    return load_megatron_weights(model_chunks, load_dir)


def _load_hf(model_chunks: list, parallel, *, hf_dir) -> int:
    """`megarl.conversion.load_hf.load_hf_weights` at ``parallel``'s layout."""
    from megarl.conversion.load_hf import load_hf_weights

    return load_hf_weights(model_chunks, hf_dir, parallel)
