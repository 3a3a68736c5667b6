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
