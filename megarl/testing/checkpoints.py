"""Test helpers for checkpoint directories."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def load_safetensors_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (a Hugging Face model directory),
    by name. Loads the whole model: for tiny test models only."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def edited_hf_dir(src: str | os.PathLike, dst: str | os.PathLike, **changes: object) -> Path:
    """A copy of the HF directory ``src`` at ``dst`` whose ``config.json`` has ``changes`` applied (a
    refused or mismatched config for a test); returns ``dst``.

    Raises:
        FileExistsError: ``dst`` exists.
    """
    dst = Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
