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
again at build time). The recipe's own rules (:func:`fp8_recipe_issues`) run in ``megarl validate``
through the launch layer's preflight.

Device support (:func:`fp8_support_error`, a pure function of the device's compute capability, the
CUDA version torch was built with and the Transformer Engine version) follows TE's own checks
(``check_fp8_support`` / ``check_fp8_block_scaling_support`` / ``check_mxfp8_support``, TE 2.3-2.9)
and the TE versions Megatron-Core 0.16.1 needs per recipe (``fp8_utils.get_fp8_recipe``). It runs
in ``megarl validate`` where a GPU is visible and again in `fp8_config` on every trainer rank, before
the model is built.

Recipe and the RL ratio. ``delayed`` scales each GEMM by the amax *history* of earlier iterations,
so the old-logprob pass and the training forward on the same weights and tokens quantise
differently and the first importance ratio is not 1: GSPO's 3e-4 clip then fires on quantisation
noise. The default is ``tensorwise`` (current scaling: the scale comes from the tensor itself);
``blockwise`` and ``mxfp8`` are history-free too. ``megarl validate`` rejects ``delayed`` with GSPO.
"""
from __future__ import annotations

from typing import Any

from megarl.config.schema import TrainConfig

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
HISTORY_FREE_RECIPES = ("tensorwise", "blockwise", "mxfp8")
"""Recipes whose scales depend only on the current tensors (the same forward twice quantises alike)."""
_TOKEN_MULTIPLE = {"delayed": 16, "tensorwise": 16, "blockwise": 128, "mxfp8": 32}
MIN_TE_VERSION = {"delayed": "2.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
"""Transformer Engine needed per recipe (Megatron-Core 0.16.1 ``get_fp8_recipe``; 2.0 for its FP8 path)."""
FP8_VERIFY_TOLERANCE = 0.1
"""Mean |logprob| gap allowed in the post-sync check when the trainer runs FP8 GEMMs and the
engine BF16 ones: the FP8-vs-BF16 gap bound of tests/gpu/test_trainer_gpu.py."""
FP8_ENGINE_VERIFY_TOLERANCE = 0.1
"""Mean |logprob| gap allowed for an engine serving a block-FP8 checkpoint (``quantization_config``
with ``weight_block_size``: the DeepSeek-V3 and Kimi-K2 recipes) against a BF16 trainer.

Measured (tests/unit/training/test_fp8_engine_tolerance.py, CPU, 2026-11-27): the DeepSeek-V3 CPU
twin (``tiny:deepseek_v3``: 2 layers, hidden 64, MLA, 8 experts) with every matrix SGLang quantises
block-FP8 quantised and dequantised (``megarl.models.fp8_blocks``, 128 x 128 blocks) and the
activations into them quantised per token in groups of 128, against the fp32 model, on 16 random
sequences of 64 tokens: mean |dlogprob| 3.4e-3 (BF16 weights alone: 7.6e-4). The bound is the
project's FP8 gap bound (:data:`FP8_VERIFY_TOLERANCE`), 30x the twin's gap: quantisation error
accumulates over depth and width (61 layers of hidden 7168 against the twin's 2 of 64), and the
served engine's own gap is checked on GPU (``tools/gpu_check.sh``)."""


def _version(text: str):
    from packaging.version import Version

    return Version(text)


def fp8_support_error(recipe: str, *, capability: tuple[int, int], torch_cuda: str | None,
                      te_version: str | None) -> str | None:
    """Why ``recipe`` cannot run on a device, or None when it can (pure; no GPU needed).

    Args:
        recipe: ``train.fp8_recipe``.
        capability: the GPU's compute capability ``(major, minor)`` (H100: ``(9, 0)``).
        torch_cuda: ``torch.version.cuda`` (the CUDA torch was built with), None for a CPU build.
        te_version: the installed Transformer Engine's version, None when it is not installed.

    Rules: every recipe needs sm_89+ (Ada needs CUDA 12.1+); ``blockwise`` needs sm_90+ and CUDA
    12.9+, and sm_90 exactly (Hopper) before TE 2.9; ``mxfp8`` needs sm_100 up to, not including,
    sm_120; TE at least :data:`MIN_TE_VERSION`.
    """
    if recipe not in FP8_RECIPES:
        return f"train.fp8_recipe={recipe!r}: expected one of {FP8_RECIPES}"
    if te_version is None:
        return "FP8 runs through Transformer Engine, which is not installed"
    if _version(te_version) < _version(MIN_TE_VERSION[recipe]):
        return f"fp8_recipe={recipe} needs Transformer Engine >= {MIN_TE_VERSION[recipe]}, found {te_version}"
    if torch_cuda is None:
        return "FP8 needs a CUDA build of torch"
    sm = f"sm_{capability[0]}{capability[1]}"
    cuda = _version(torch_cuda)
    if tuple(capability) < (8, 9):
        return f"FP8 needs compute capability 8.9 or higher (Ada, Hopper, Blackwell); this GPU is {sm}"
    if recipe in ("delayed", "tensorwise") and tuple(capability) < (9, 0) and cuda < _version("12.1"):
        return f"FP8 on Ada ({sm}) needs CUDA 12.1 or higher; torch is built with CUDA {torch_cuda}"
    if recipe == "blockwise":
        hopper_only = _version(te_version) < _version("2.9")
        if tuple(capability) < (9, 0) or (hopper_only and tuple(capability) >= (10, 0)):
            where = "Hopper (sm_90)" if hopper_only else "compute capability 9.0 or higher"
            return (f"fp8_recipe=blockwise needs {where} with Transformer Engine {te_version}; this GPU "
                    f"is {sm} (use tensorwise{', or mxfp8 on Blackwell' if capability[0] == 10 else ''})")
        if cuda < _version("12.9"):
            return (f"fp8_recipe=blockwise needs a torch built with CUDA 12.9 or higher; torch is built "
                    f"with CUDA {torch_cuda} (use tensorwise)")
    if recipe == "mxfp8" and not (10, 0) <= tuple(capability) < (12, 0):
        return f"fp8_recipe=mxfp8 needs Blackwell datacenter GPUs (sm_100 / sm_103); this GPU is {sm}"
    return None


def installed_te_version() -> str | None:
    """The installed Transformer Engine's version (package metadata), or None."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def fp8_support_error_here(recipe: str) -> str | None:
    """:func:`fp8_support_error` for this process's current CUDA device (None without a GPU: unknown)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return fp8_support_error(recipe, capability=torch.cuda.get_device_capability(),
                             torch_cuda=torch.version.cuda, te_version=installed_te_version())


def fp8_recipe_issues(train_cfg: TrainConfig, policy_loss: str, *, cuda: bool) -> list[tuple[str, str]]:
    """``train.fp8_recipe`` against the algorithm and, where a GPU is visible, the device, torch and TE.

    Args:
        train_cfg: the ``train`` section, with ``fp8`` set.
        policy_loss: ``algorithm.policy_loss``; a loss whose registry entry declares a
            ``sequence`` ratio (GSPO) needs a recipe without scaling history.
        cuda: the run uses CUDA (``megarl.config.device.use_cuda``).

    Returns:
        ``(key, message)`` pairs; empty when the recipe can run (an unknown recipe is the config
        domain's to report).
    """
    recipe, issues = train_cfg.fp8_recipe, list[tuple[str, str]]()
    if recipe not in FP8_RECIPES:
        return issues
    from megarl.algorithms.extensions import POLICY_LOSSES

    loss = POLICY_LOSSES.get_entry(policy_loss)  # None: unknown, reported by the config's domain
    if loss is not None and loss.ratio_level == "sequence" and recipe not in HISTORY_FREE_RECIPES:
        issues.append(("train.fp8_recipe",
                       "delayed scaling quantises the old-logprob pass and the training forward with different "
                       "(history) scales, so GSPO's first sequence ratio is not 1 and its 3e-4 clip fires on FP8 "
                       f"noise; use one of {', '.join(HISTORY_FREE_RECIPES)}"))
    if cuda:
        error = fp8_support_error_here(recipe)  # None where no GPU is visible: checked again at build
        if error is not None:
            issues.append(("train.fp8_recipe", error))
    return issues


def verify_tolerance(train_cfg: TrainConfig, tolerance: float, *, engine_block_fp8: bool) -> float:
    """The post-sync check's tolerance, from what each side computes with.

    Args:
        train_cfg: the ``train`` section (``fp8``: the trainer's logprobs come from FP8 GEMMs).
        tolerance: ``weight_sync.verify_tolerance`` (BF16 trainer vs BF16 engine).
        engine_block_fp8: the engines serve a block-FP8 checkpoint (its ``quantization_config``).

    Returns:
        ``tolerance``, or where larger the sum of the bounds of the gaps present:
        :data:`FP8_VERIFY_TOLERANCE` (FP8 trainer) plus :data:`FP8_ENGINE_VERIFY_TOLERANCE`
        (block-FP8 engine); the mean of ``|a - c|`` is at most that of ``|a - b|`` plus ``|b - c|``.
    """
    gaps = (FP8_VERIFY_TOLERANCE if train_cfg.fp8 is not None else 0.0) + \
        (FP8_ENGINE_VERIFY_TOLERANCE if engine_block_fp8 else 0.0)
    return max(tolerance, gaps)


def fp8_config(train_cfg: TrainConfig, *, is_moe: bool, cuda: bool) -> dict:
    """Extra ``TransformerConfig`` fields for ``train.fp8`` (empty when FP8 is off).

    Args:
        train_cfg: the ``train`` section (``fp8``, ``fp8_recipe``).
        is_moe: the model has experts (pads routing maps for FP8 expert GEMMs).
        cuda: CUDA (and Transformer Engine) are available.

    Returns:
        ``{"fp8": ..., "fp8_recipe": ..., ...}`` for ``build_model(extra_config=...)``.

    Raises:
        ValueError: FP8 requested without CUDA, an unknown format / recipe, or a recipe this GPU,
            torch build or Transformer Engine cannot run (names the field).
    """
    if train_cfg.fp8 is None:
        return {}
    if train_cfg.fp8 not in FP8_FORMATS:
        raise ValueError(f"train.fp8 must be one of {FP8_FORMATS} or null, got {train_cfg.fp8!r}")
    if train_cfg.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe must be one of {FP8_RECIPES}, got {train_cfg.fp8_recipe!r}")
    if not cuda:
        raise ValueError("train.fp8 needs CUDA and Transformer Engine; set train.fp8=null on CPU")
    error = fp8_support_error_here(train_cfg.fp8_recipe)
    if error:
        raise ValueError(f"train.fp8_recipe={train_cfg.fp8_recipe}: {error}")
    extra: dict[str, Any] = {"fp8": train_cfg.fp8, "fp8_recipe": train_cfg.fp8_recipe}
    if train_cfg.fp8_recipe == "delayed":
        # Megatron-LM's usual delayed-scaling settings: scale from the max amax of a long history.
        extra.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    if is_moe:
        extra["moe_router_padding_for_fp8"] = True
    return extra


def fp8_token_multiple(train_cfg: TrainConfig) -> int:
    """Tokens per micro batch (per sequence-parallel shard) must be a multiple of this (1 = no FP8)."""
    return 1 if train_cfg.fp8 is None else _TOKEN_MULTIPLE[train_cfg.fp8_recipe]
