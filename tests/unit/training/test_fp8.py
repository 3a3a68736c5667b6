"""FP8 settings: rejected without CUDA, mapped to Megatron's TransformerConfig fields with it."""
import pytest

from megarl.config.schema import TrainConfig
from megarl.training.fp8 import fp8_config, fp8_token_multiple


@pytest.mark.timeout(30)
def test_fp8_rejected_on_cpu_and_off_by_default():
    assert fp8_config(TrainConfig(), is_moe=True, cuda=False) == {}
    assert fp8_token_multiple(TrainConfig()) == 1
    with pytest.raises(ValueError, match="train.fp8 needs CUDA"):
        fp8_config(TrainConfig(fp8="e4m3"), is_moe=True, cuda=False)
    with pytest.raises(ValueError, match="train.fp8_recipe"):
        fp8_config(TrainConfig(fp8="e4m3", fp8_recipe="fancy"), is_moe=False, cuda=True)


@pytest.mark.timeout(30)
def test_fp8_fields_are_valid_transformer_config_fields():
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        extra = fp8_config(TrainConfig(fp8="hybrid", fp8_recipe=recipe), is_moe=True, cuda=True)
        assert extra["fp8"] == "hybrid" and extra["fp8_recipe"] == recipe
        assert set(extra) <= names
        assert fp8_token_multiple(TrainConfig(fp8="hybrid", fp8_recipe=recipe)) % 16 == 0


# (recipe, capability, torch CUDA, TE version, substring of the error or None = supported)
SUPPORT = [
    ("tensorwise", (9, 0), "12.8", "2.9.0", None),                 # H100
    ("tensorwise", (8, 9), "12.4", "2.5.0", None),                 # L40S (Ada)
    ("tensorwise", (8, 9), "12.0", "2.5.0", "CUDA 12.1"),          # Ada needs CUDA 12.1
    ("tensorwise", (8, 0), "12.8", "2.9.0", "8.9 or higher"),      # A100: no FP8
    ("tensorwise", (9, 0), "12.8", "2.1.0", ">= 2.2.0.dev0"),      # current scaling came in TE 2.2
    ("delayed", (8, 6), "12.8", "2.9.0", "8.9 or higher"),
    ("delayed", (10, 0), "12.8", "2.9.0", None),
    ("blockwise", (9, 0), "12.9", "2.5.0", None),                  # H100, CUDA 12.9 torch
    ("blockwise", (9, 0), "12.8", "2.9.0", "CUDA 12.9"),           # torch cu128 build
    ("blockwise", (8, 9), "12.9", "2.9.0", "9.0 or higher"),
    ("blockwise", (10, 0), "12.9", "2.8.0", "Hopper (sm_90)"),     # Blackwell before TE 2.9
    ("blockwise", (10, 0), "12.9", "2.9.0", None),
    ("blockwise", (9, 0), "12.9", "2.2.0", ">= 2.3.0.dev0"),
    ("mxfp8", (10, 0), "12.8", "2.9.0", None),                     # B200
    ("mxfp8", (9, 0), "12.8", "2.9.0", "sm_100"),                  # H100
    ("mxfp8", (12, 0), "12.8", "2.9.0", "sm_100"),                 # RTX 50xx (sm_120)
    ("mxfp8", (10, 0), "12.8", None, "not installed"),
    ("mxfp8", (10, 0), None, "2.9.0", "CUDA build"),
]


@pytest.mark.parametrize("recipe,capability,cuda,te,error", SUPPORT)
def test_fp8_support_table(recipe, capability, cuda, te, error):
    from megarl.training.fp8 import fp8_support_error

    got = fp8_support_error(recipe, capability=capability, torch_cuda=cuda, te_version=te)
    if error is None:
        assert got is None
    else:
        assert got is not None and error in got, got


def test_default_recipe_is_history_free_and_verify_tolerance_widens_under_fp8():
    from megarl.training.fp8 import FP8_VERIFY_TOLERANCE, HISTORY_FREE_RECIPES, verify_tolerance

    assert TrainConfig().fp8_recipe in HISTORY_FREE_RECIPES
    assert verify_tolerance(TrainConfig(), 1e-2, engine_block_fp8=False) == 1e-2
    assert verify_tolerance(TrainConfig(fp8="e4m3"), 1e-2, engine_block_fp8=False) == FP8_VERIFY_TOLERANCE
    assert verify_tolerance(TrainConfig(fp8="e4m3"), 0.5, engine_block_fp8=False) == 0.5
