"""initial_weights: model.load_dir wins over model.hf_path's HF weights; neither: no loader.

The real loaders run on empty directories: which directory the error names shows which source the
returned loader reads (no stand-ins; the weights themselves are checked end to end by
tests/integration/training/test_trainer_load_dir.py, whose hf_path and load_dir hold different models).
"""
import pytest

from megarl.config.schema import ModelConfig
from megarl.conversion.initial_weights import initial_weights


@pytest.fixture()
def empty_dirs(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "hf").mkdir()
    return tmp_path / "ckpt", tmp_path / "hf"


def test_load_dir_wins_over_hf_path(empty_dirs):
    ckpt, hf = empty_dirs
    loader = initial_weights(ModelConfig(hf_path=str(hf), load_dir=str(ckpt)))
    with pytest.raises(FileNotFoundError, match="is not a Megatron dist checkpoint") as err:
        loader([], None)
    assert str(ckpt) in str(err.value) and str(hf) not in str(err.value)


def test_hf_path_without_load_dir(empty_dirs):
    _, hf = empty_dirs
    loader = initial_weights(ModelConfig(hf_path=str(hf)))
    with pytest.raises(ValueError) as err:  # transformers: no config.json with a model_type
        loader([], None)
    assert str(hf) in str(err.value)


def test_no_loader_when_neither():
    assert initial_weights(ModelConfig(hf_path="/hf", load_weights=False)) is None
