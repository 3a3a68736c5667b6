"""``model.load_dir``: start training from a Megatron dist checkpoint instead of HF safetensors.

Accepted directories (any parallel layout: tensors are stored once by global shape and offset):

- the output of ``megarl convert hf-to-megatron`` (model weights, ``megarl_checkpoint.json`` and
  the HF metadata in ``hf_config/``);
- a trainer checkpoint: ``RUN/checkpoints/step_N`` or its ``trainer/`` directory (only the model
  weights are read; the optimizer, scheduler and step start fresh).

:func:`check_load_dir` is what ``megarl validate`` runs (metadata only, no tensor read);
:func:`load_megatron_weights` is what each trainer rank runs at build time, before DDP and the
optimizer copy the parameters.

Vocabulary padding: the embedding and output layer hold ``padded_vocab`` rows, a multiple of
``make_vocab_size_divisible_by x TP`` of the layout that saved them. Rows beyond the real
vocabulary are never used (megarl excludes them from the softmax), so a checkpoint padded
differently from the trainer loads: the rows both have are read and the trainer's remaining padding
rows are zero, as :func:`~megarl.conversion.load_hf.load_hf_weights` leaves them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megarl.conversion.convert import HF_CONFIG_SUBDIR, MARKER_FILE, resolve_checkpoint_dir

_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def check_load_dir(load_dir: str | os.PathLike, hf_path: str | os.PathLike) -> None:
    """Check that ``load_dir`` holds the model ``hf_path/config.json`` describes (metadata only).

    Checked: a dist checkpoint is there; the family recorded by the converter
    (``megarl_checkpoint.json``) and the HF config stored with the checkpoint (``hf_config/``)
    agree with ``hf_path``'s (architecture fields); the checkpoint's tensor shapes fit that config
    (layers, hidden size, heads, experts, vocabulary, tied embeddings). The recorded parallel
    layout, precision and vocabulary padding need not match the run's: they are resharded, cast
    and re-padded at load.

    Raises:
        FileNotFoundError: not a dist checkpoint.
        megarl.conversion.config_check.ConfigMismatchError: the checkpoint is of another model
            (names the field, both values and the files).
        ValueError: unreadable marker file or no model in the checkpoint.
    """
    from megarl.conversion.config_check import ConfigMismatchError, check_checkpoint_matches_config, compare_configs
    from megarl.conversion.dist_ckpt import model_prefix, tensor_shapes
    from megarl.training.model import load_hf_config

    ckpt = resolve_checkpoint_dir(load_dir)
    hf_config = load_hf_config(str(hf_path))
    config_file = Path(hf_path) / "config.json"
    marker = ckpt / MARKER_FILE
    if marker.is_file():
        try:
            family = json.loads(marker.read_text())["family"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{marker} is not a megarl conversion record: {e}") from e
        if family != hf_config.model_type:
            raise ConfigMismatchError(f"model_type: {hf_config.model_type!r} in {config_file}, but {marker} records "
                                      f"a conversion of a {family!r} model")
    stored = ckpt / HF_CONFIG_SUBDIR / "config.json"
    if stored.is_file():
        compare_configs(load_hf_config(str(stored.parent)), hf_config, expected_file=stored, actual_file=config_file)
    shapes = tensor_shapes(ckpt)
    check_checkpoint_matches_config(shapes, model_prefix(shapes), hf_config, config_file, ckpt)


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _read_vocab_rows(reader, value, rows_saved: int) -> torch.Tensor:
    """This rank's shard of a vocabulary-padded tensor; rows the checkpoint lacks are zero."""
    out = torch.zeros(tuple(value.local_shape), dtype=value.dtype)
    start = value.global_offset[value.prepend_axis_num]
    num = max(0, min(out.shape[0], rows_saved - start))
    if num:
        offsets = list(value.global_offset)
        sizes = [1] * value.prepend_axis_num + [num, *out.shape[1:]]
        reader.read_region(value.key, offsets, sizes, out=out[:num].view(sizes))
    return out


def load_megatron_weights(model_chunks, load_dir: str | os.PathLike) -> int:
    """Fill this rank's model chunks from a dist checkpoint, one group (embedding, layer, output
    layer) at a time; no collective (each rank reads only its own regions).

    Args:
        model_chunks: from :func:`megarl.training.model.build_model` (DDP-wrapped chunks are
            unwrapped), on any device and in any precision (tensors are cast on copy).
        load_dir: as accepted by :func:`~megarl.conversion.convert.resolve_checkpoint_dir`.

    Returns:
        Number of tensors loaded.

    Raises:
        FileNotFoundError: not a dist checkpoint.
        RuntimeError: the checkpoint lacks parameters of this model (names them).
        KeyError / ValueError: a tensor missing from, or not covered by, the checkpoint.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megarl.conversion.dist_ckpt import CheckpointReader, model_prefix, tensor_shapes
    from megarl.conversion.groups import group_sharded_state_dict, module_groups

    ckpt = resolve_checkpoint_dir(load_dir)
    shapes = tensor_shapes(ckpt)
    prefix = model_prefix(shapes)
    chunks = [_unwrap(c) for c in model_chunks]
    reader = CheckpointReader(ckpt)
    loaded: list[set[str]] = [set() for _ in chunks]
    try:
        for index, modules in module_groups(chunks):
            wanted = group_sharded_state_dict(chunks[index], modules, prefix=prefix, materialized_only=False)
            state = {}
            for name, value in wanted.items():
                if name.endswith("_extra_state") or not hasattr(value, "key"):
                    continue  # TE's fp8 metadata and other non-tensor entries: not model weights
                if value.key not in shapes and isinstance(value, ShardedTensor):
                    raise RuntimeError(f"checkpoint {ckpt} lacks model parameter {value.key}")
                key = value.key[len(prefix):] if isinstance(value, ShardedTensor) else ""
                if key in _VOCAB_KEYS:
                    state[name] = _read_vocab_rows(reader, value, shapes[value.key][0][value.prepend_axis_num])
                else:
                    state[name] = reader.load({name: value})[name]
            result = chunks[index].load_state_dict(state, strict=False)
            if result.unexpected_keys:
                raise RuntimeError(f"checkpoint {ckpt}: unexpected keys {result.unexpected_keys[:5]}")
            loaded[index] |= set(state)
    finally:
        reader.close()
    missing = [n for chunk, names in zip(chunks, loaded) for n, _ in chunk.named_parameters() if n not in names]
    if missing:
        raise RuntimeError(f"checkpoint {ckpt} lacks model parameters: {missing[:5]}")
    return sum(len(names) for names in loaded)
