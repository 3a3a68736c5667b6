"""initial_weights: model.load_dir wins over model.hf_path's HF weights; neither: no loader."""
from megarl.conversion import load_dir, load_hf
from megarl.conversion.initial_weights import initial_weights
from megarl.config.schema import ModelConfig


def test_load_dir_then_hf_weights_then_none(monkeypatch):
    calls = []
    monkeypatch.setattr(load_dir, "load_megatron_weights", lambda chunks, d: calls.append(("megatron", chunks, d)))
    monkeypatch.setattr(load_hf, "load_hf_weights", lambda chunks, d, p: calls.append(("hf", chunks, d, p)))

    initial_weights(ModelConfig(hf_path="/hf", load_dir="/ckpt"))(["chunk"], "parallel")
    initial_weights(ModelConfig(hf_path="/hf"))(["chunk"], "parallel")
    assert calls == [("megatron", ["chunk"], "/ckpt"), ("hf", ["chunk"], "/hf", "parallel")]
    assert initial_weights(ModelConfig(hf_path="/hf", load_weights=False)) is None
