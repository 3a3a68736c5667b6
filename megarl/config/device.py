"""Where a run computes: ``cluster.device`` resolved, and the precision that follows from it.

Every layer asks :func:`use_cuda` (config validation, Ray placement, the trainer's build, the
parallel state), so "is this CUDA?" is decided one way.
"""
from __future__ import annotations

from typing import Any


def use_cuda(device: str) -> bool:
    """``cluster.device`` -> whether the run uses CUDA: ``cuda`` yes, ``cpu`` no, ``auto`` when torch
    sees a GPU in this process (no torch installed: no)."""
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolved_precision(cfg: Any) -> str:
    """``train.precision`` with ``auto`` resolved: bf16 on CUDA, fp32 on CPU (Megatron-Core's CPU path)."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    return "bf16" if use_cuda(cfg.cluster.device) else "fp32"
