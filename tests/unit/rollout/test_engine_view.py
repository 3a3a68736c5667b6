"""The untied view an engine serves for a tied Qwen3-MoE / GLM-4.5 checkpoint (megarl.rollout.engine_view):
built once and reused, rebuilt when the checkpoint changes, and the same model for transformers."""
from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megarl.rollout.engine_view import needs_untied_view, served_model_dir


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})
    return out


def test_sglang_keeps_lm_head_apart_in_exactly_these_families():
    """Read from SGLang 0.5.23's source (importing the model files needs torchvision): qwen3_moe.py and
    glm4_moe.py build a ParallelLMHead of their own and never read tie_word_embeddings; qwen3.py and
    deepseek_v2.py tie lm_head to embed_tokens when it says so."""
    models = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "models"
    for name in ("qwen3_moe.py", "glm4_moe.py"):
        text = (models / name).read_text()
        assert "tie_word_embeddings" not in text and "self.lm_head = ParallelLMHead(" in text, name
    for name in ("qwen3.py", "deepseek_v2.py"):
        assert "self.lm_head = self.model.embed_tokens" in (models / name).read_text(), name
    assert needs_untied_view({"model_type": "qwen3_moe", "tie_word_embeddings": True})
    assert needs_untied_view({"model_type": "glm4_moe", "tie_word_embeddings": True})
    assert not needs_untied_view({"model_type": "qwen3_moe"})
    assert not needs_untied_view({"model_type": "qwen3", "tie_word_embeddings": True})
    assert not needs_untied_view({"model_type": "deepseek_v3", "tie_word_embeddings": True})


def test_untied_checkpoints_and_non_directories_pass_through(tiny_moe_dir, tmp_path):
    assert served_model_dir(tiny_moe_dir, root=tmp_path) == str(tiny_moe_dir)
    assert served_model_dir("/no/such/model", root=tmp_path) == "/no/such/model"
    assert not any(tmp_path.iterdir())


def test_view_of_a_tied_checkpoint_is_the_same_model_untied(tiny_tied_moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    view = Path(served_model_dir(tiny_tied_moe_dir, root=tmp_path))
    assert view.parent == tmp_path
    assert json.loads((view / "config.json").read_text())["tie_word_embeddings"] is False
    assert (view / "model-00001.safetensors").resolve() == (tiny_tied_moe_dir / "model.safetensors").resolve()
    assert (view / "tokenizer.json").is_symlink()
    original, untied = _tensors(tiny_tied_moe_dir), _tensors(view)
    assert "lm_head.weight" not in original
    assert set(untied) == set(original) | {"lm_head.weight"}
    assert torch.equal(untied["lm_head.weight"], original["model.embed_tokens.weight"])
    ids = torch.tensor([[5, 17, 300, 42, 7, 1999]])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(ids).logits
                  for d in (tiny_tied_moe_dir, view)]
    assert torch.equal(logits[0], logits[1])


def test_view_is_built_once_and_rebuilt_when_the_checkpoint_changes(tiny_tied_moe_dir, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    for entry in tiny_tied_moe_dir.iterdir():
        (src / entry.name).write_bytes(entry.read_bytes())
    root = tmp_path / "cache"
    views: list[str] = []
    threads = [threading.Thread(target=lambda: views.append(served_model_dir(src, root=root))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(views)) == 1 and [p.name for p in root.iterdir()] == [Path(views[0]).name]  # no leftovers
    written = (Path(views[0]) / "lm_head.safetensors").stat().st_mtime_ns
    assert served_model_dir(src, root=root) == views[0]
    assert (Path(views[0]) / "lm_head.safetensors").stat().st_mtime_ns == written
    weights = src / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # retrained in place
    assert served_model_dir(src, root=root) != views[0]


def test_view_of_a_sharded_checkpoint_names_lm_head_in_its_index(tiny_tied_moe_dir, tmp_path):
    """SGLang loads only the files a model.safetensors.index.json names."""
    src = tmp_path / "ckpt"
    src.mkdir()
    for entry in tiny_tied_moe_dir.iterdir():
        (src / entry.name).symlink_to(entry)
    weight_map = {name: "model.safetensors" for name in _tensors(tiny_tied_moe_dir)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    view = Path(served_model_dir(src, root=tmp_path / "cache"))
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {**weight_map, "lm_head.weight": "lm_head.safetensors"}


class _NotStarted(Exception):
    pass


def test_engine_process_serves_the_view(tiny_tied_moe_dir, tmp_path, monkeypatch):
    """EngineProcess.start hands SGLang the view (prepared on the engine's node, before the server starts)."""
    import subprocess

    from megarl.rollout.engine_process import EngineProcess

    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    commands = []

    def popen(cmd, **_):
        commands.append(cmd)
        raise _NotStarted

    monkeypatch.setattr(subprocess, "Popen", popen)
    engine = EngineProcess(tiny_tied_moe_dir, device="cpu", port=1, log_path=tmp_path / "e.log")
    with pytest.raises(_NotStarted):
        engine.start()
    engine.stop()
    served = commands[0][commands[0].index("--model-path") + 1]
    assert Path(served).parent == tmp_path / "untied" and engine.model_path == str(tiny_tied_moe_dir)
