"""A block-FP8 checkpoint served on CPU: SGLang loads its dequantisation, the weight sync still sends FP8.

SGLang 0.5.23 on CPU runs block-FP8 linears only with Intel AMX and the ``sgl_kernel`` CPU build
(``Fp8LinearMethod.process_weights_after_loading`` asserts ``cpu_has_amx_support()``), so a CPU engine
cannot serve a checkpoint with a block-wise ``quantization_config`` (the DeepSeek-V3 and Kimi-K2 recipes'
twins, :mod:`megarl.launch.cpu_scale`). Such an engine serves a *dequantised view* instead, written
once per node and cached like the untied view (:mod:`megarl.rollout.engine_view`): ``config.json``
without ``quantization_config`` but with :data:`VIEW_KEY` (the checkpoint's directory and its
``quantization_config``), and every weight as ``q * scale_inv`` per block
in float32 (:func:`~megarl.models.fp8_blocks.dequantize_blockwise`, as the trainer's import reads it),
without the ``_scale_inv`` tensors; tokenizer files are linked.

The trainer does not know: it plans and sends block-FP8 on the wire as for GPU engines
(:mod:`megarl.weight_sync.fp8_wire`: the sender quantises, each engine rank gets its FP8 slice and its
scale blocks). The engine-side receiver checks what arrives against the *checkpoint's* tensors (FP8
dtypes, ``_scale_inv`` shapes: :func:`wire_manifest_dir`) and, before loading, turns each FP8 slice and
its scales back into the weight the view holds (:func:`served_tensors`). So on CPU the sync's wire,
checks and load groups are the GPU ones; what differs is SGLang's FP8 kernels, which a GPU run checks
(``tools/gpu_check.sh``). The whole model is held in memory once while the view is written: meant for
CPU-sized models.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.rollout.engine_view import cache_root, cached_view

if TYPE_CHECKING:
    import torch

VIEW_KEY = "megarl_dequantized_from"
"""``config.json`` key of a dequantised view: ``{"path": checkpoint dir, "quantization_config": {...}}``."""
WEIGHTS = "model.safetensors"


def needs_dequantized_view(config: dict) -> bool:
    """``config.json`` (a dict) announces block-FP8 weights (a ``quantization_config``)."""
    return bool(config.get("quantization_config"))


def write_dequantized_view(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the dequantised view of the block-FP8 checkpoint ``src`` into the new directory ``out``
    (one ``model.safetensors``, float32: the whole model is read into memory).

    Raises:
        FileNotFoundError: ``src`` has no ``config.json``. ValueError: its ``quantization_config`` is
            not block-wise e4m3 FP8 (names the field), or an FP8 weight has no ``_scale_inv``.
    """
    from safetensors.torch import load_file, save_file

    from megarl.models.fp8_blocks import parse_quantization_config

    src, out = Path(src).resolve(), Path(out)
    config = json.loads((src / "config.json").read_text())
    quantization = parse_quantization_config(config.get("quantization_config"),
                                             where=f"{src}/config.json quantization_config")
    out.mkdir(parents=True)
    stored: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        stored.update(load_file(str(path)))
    block = quantization.block if quantization is not None else (128, 128)
    weights = dict(_dequantized(list(stored.items()), block, where=str(src)))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    config[VIEW_KEY] = {"path": str(src), "quantization_config": config.pop("quantization_config")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for entry in sorted(src.iterdir()):
        if entry.name != "config.json" and not entry.name.endswith((".safetensors", ".index.json")):
            (out / entry.name).symlink_to(entry)
    return out


def _dequantized(named: Sequence[tuple[str, torch.Tensor]], block: Sequence[int], *,
                 where: str) -> list[tuple[str, torch.Tensor]]:
    """Each ``float8_e4m3fn`` tensor of ``named`` times its ``<name>_scale_inv`` blocks (fp32), its scales
    dropped, the rest unchanged.

    Raises:
        ValueError: an FP8 tensor whose scales are not in ``named`` (names both and ``where``).
    """
    import torch

    from megarl.models.fp8_blocks import dequantize_blockwise, scale_name

    tensors = dict(named)
    out = []
    for name, tensor in named:
        if name.endswith("_scale_inv") and name[:-len("_scale_inv")] in tensors:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors.get(scale_name(name))
            if scale is None:
                raise ValueError(f"{where}: {name} is FP8 but {scale_name(name)} is not beside it")
            tensor = dequantize_blockwise(tensor, scale, block, dtype=torch.float32)
        out.append((name, tensor))
    return out


def dequantized_model_dir(model_dir: str | os.PathLike, *, root: str | os.PathLike | None = None) -> str:
    """``model_dir`` itself, or its dequantised view where its ``config.json`` announces block FP8
    (built once per checkpoint version under ``root``, default ``$MEGARL_CACHE_DIR/dequantized``)."""
    src = Path(model_dir)
    if not (src / "config.json").is_file() or not needs_dequantized_view(json.loads((src / "config.json").read_text())):
        return str(model_dir)
    return cached_view(src, Path(root) if root is not None else cache_root() / "dequantized", write_dequantized_view)


@lru_cache(maxsize=8)
def _view_source(model_path: str) -> tuple[str, tuple[int, int]] | None:
    """``(checkpoint dir, block)`` of a dequantised view (None: ``model_path`` is not one)."""
    from megarl.models.fp8_blocks import parse_quantization_config

    config = Path(model_path) / "config.json"
    view = json.loads(config.read_text()).get(VIEW_KEY) if config.is_file() else None
    if not view:
        return None
    quantization = parse_quantization_config(view["quantization_config"], where=f"{config} {VIEW_KEY}")
    return str(view["path"]), quantization.block if quantization is not None else (128, 128)


def wire_manifest_dir(model_path: str) -> str:
    """The directory whose tensors a weight update for an engine serving ``model_path`` carries: the
    block-FP8 checkpoint of a dequantised view, else ``model_path``."""
    source = _view_source(str(model_path))
    return source[0] if source is not None else str(model_path)


def served_tensors(model_path: str, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors an engine serving ``model_path`` loads for ``named`` (one rank's received slices):
    unchanged, or for a dequantised view each ``float8_e4m3fn`` slice times its ``<name>_scale_inv``
    blocks (fp32 product, :func:`~megarl.models.fp8_blocks.dequantize_blockwise`), the scales dropped.

    An engine rank's FP8 slice starts on a block boundary and its scale slice holds exactly its blocks
    (:func:`~megarl.weight_sync.engine_slices.engine_slices`), so the slice dequantises on its own.

    Raises:
        ValueError: an FP8 tensor without its scales in ``named`` (the load group keeps them together).
    """
    source = _view_source(str(model_path))
    if source is None:
        return list(named)
    return _dequantized(named, source[1], where=f"update of {model_path}")
