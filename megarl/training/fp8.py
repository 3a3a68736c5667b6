"""FP8 training through Transformer Engine (GPU only): ``train.fp8`` / ``train.fp8_recipe`` to Megatron.

Megatron-Core runs FP8 GEMMs through Transformer Engine when its ``TransformerConfig`` has
``fp8`` (``e4m3``: E4M3 forward and backward; ``hybrid``: E4M3 forward, E5M2 gradients) and
``fp8_recipe`` (``delayed``: per-tensor scales from an amax history; ``tensorwise``: current
per-tensor scaling; ``blockwise``: 1x128 / 128x128 block scales (Hopper); ``mxfp8``: MX block
scaling (Blackwell)). Parameters stay BF16 (``fp8_param`` off); the optimizer keeps fp32 main
weights. Without ``train.fp8`` training is BF16.

FP8 GEMMs need token counts divisible by 16 (MXFP8: 32; blockwise: 128 is used to be safe), so
micro batches are padded to that multiple (times TP under sequence parallelism), and MoE routing
maps are padded per expert (Megatron's ``moe_router_padding_for_fp8``).

On CPU these settings are rejected (``megarl.config.validate`` does so before a run; `fp8_config`
again at build time).
"""
from __future__ import annotations

from megarl.config.schema import TrainConfig

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
_TOKEN_MULTIPLE = {"delayed": 16, "tensorwise": 16, "blockwise": 128, "mxfp8": 32}


def fp8_config(train_cfg: TrainConfig, *, is_moe: bool, cuda: bool) -> dict:
    """Extra ``TransformerConfig`` fields for ``train.fp8`` (empty when FP8 is off).

    Args:
        train_cfg: the ``train`` section (``fp8``, ``fp8_recipe``).
        is_moe: the model has experts (pads routing maps for FP8 expert GEMMs).
        cuda: CUDA (and Transformer Engine) are available.

    Returns:
        ``{"fp8": ..., "fp8_recipe": ..., ...}`` for ``build_model(extra_config=...)``.

    Raises:
        ValueError: FP8 requested without CUDA, or an unknown format / recipe (names the field).
    """
    if train_cfg.fp8 is None:
        return {}
    if train_cfg.fp8 not in FP8_FORMATS:
        raise ValueError(f"train.fp8 must be one of {FP8_FORMATS} or null, got {train_cfg.fp8!r}")
    if train_cfg.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe must be one of {FP8_RECIPES}, got {train_cfg.fp8_recipe!r}")
    if not cuda:
        raise ValueError("train.fp8 needs CUDA and Transformer Engine; set train.fp8=null on CPU")
    extra = {"fp8": train_cfg.fp8, "fp8_recipe": train_cfg.fp8_recipe}
    if train_cfg.fp8_recipe == "delayed":
        # Megatron-LM's usual delayed-scaling settings: scale from the max amax of a long history.
        extra.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    if is_moe:
        extra["moe_router_padding_for_fp8"] = True
    return extra


def fp8_token_multiple(train_cfg: TrainConfig) -> int:
    """Tokens per micro batch (per sequence-parallel shard) must be a multiple of this (1 = no FP8)."""
    return 1 if train_cfg.fp8 is None else _TOKEN_MULTIPLE[train_cfg.fp8_recipe]
