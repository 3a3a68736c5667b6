"""Test helpers for checkpoint directories."""
from __future__ import annotations

import os

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
