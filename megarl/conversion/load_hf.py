"""Load HF weights into a rank's Megatron model chunks, one parameter's TP / ETP shard at a time
(the parameters and their sharding: :mod:`megarl.models.params`)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.mapping import ModelLayout, hf_names_for, split_tp, to_megatron
from megarl.models.params import ParamInfo, iter_global_params


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_dir: str | os.PathLike, parallel_state,
                    *, layout: ModelLayout | None = None) -> int:
    """Copy HF weights into this rank's model chunks, one tensor at a time.

    Each rank reads only the HF tensors its parameters are made of (its layers, its experts),
    transforms them (q/k/v fusion, gate/up fusion, vocabulary padding with zero rows) and copies its
    TP/ETP shard into the parameter. Peak extra memory: the HF tensors of one parameter.

    Args:
        model_chunks: from :func:`megarl.training.model.build_model`.
        hf_dir: HF model directory (config.json + safetensors).
        parallel_state: this rank's ``ParallelState``.
        layout: default: from ``hf_dir``'s config.

    Returns:
        Number of parameters loaded.

    Raises:
        CheckpointFileError: missing/truncated shard. KeyError: a tensor absent from the checkpoint.
        ConfigMismatchError: config.json disagrees with the safetensors (names field, values, file).
        ValueError: a tensor shape that does not match the model (names both).
    """
    from megarl.conversion.config_check import check_weights_match_config
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config

    hf_config = load_hf_config(hf_dir)
    layout = layout or get_family(hf_config).layout(hf_config, tp_size=parallel_state.tp_size)
    reader = HFCheckpointReader(hf_dir)
    check_weights_match_config(hf_dir, hf_config, reader)  # headers only: names field, values, file
    count = 0
    for info, param in iter_global_params(model_chunks, parallel_state, layout):
        load_param(info, param, reader, layout, parallel_state)
        count += 1
    return count


def load_param(info: ParamInfo, param: torch.Tensor, reader: HFCheckpointReader, layout: ModelLayout,
               parallel_state, *, assign: bool = False) -> None:
    """Copy one parameter's TP/ETP shard from the HF checkpoint (see :func:`load_hf_weights`).

    With ``assign`` the parameter's storage is replaced by the converted shard instead of copied
    into (the converters' freshly materialised CPU parameters; saves one copy of the model).

    Raises:
        KeyError: a tensor absent from the checkpoint. ValueError: shape mismatch (names both).
    """
    rank, size = ((parallel_state.etp_rank, parallel_state.etp_size) if info.expert
                  else (parallel_state.tp_rank, parallel_state.tp_size))
    names = hf_names_for(info.global_name, layout) or ["model.embed_tokens.weight"]  # tied output
    tensors = [reader.get(n) for n in names]
    if info.entry.transform.value == "vocab":
        layout = dataclasses.replace(layout, padded_vocab_size=param.shape[0] * size)
    local = split_tp(to_megatron(info.entry, tensors, layout), info.tp_split, rank, size, layout)
    if tuple(local.shape) != tuple(param.shape):
        raise ValueError(f"{info.global_name}: shape {tuple(local.shape)} from HF {names} in "
                         f"{reader.hf_dir} does not match the model's {tuple(param.shape)}")
    if assign and local.device == param.device:
        local = local.to(param.dtype).contiguous()
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            local = local.clone()  # a view of a larger tensor: keep only the shard
        param.data = local
        return
    with torch.no_grad():
        param.copy_(local)
