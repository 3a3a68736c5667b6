"""Load HF weights into a rank's Megatron model chunks, and enumerate those chunks' parameters
under their global names (used by the weight sync).

Sharding: a parameter of expert ``E`` lives on EP rank ``E // num_local_experts``; non-expert
parameters are split over the tensor-parallel group (``tp_rank``/``tp_size``), expert parameters
over the expert tensor-parallel group (``etp_rank``/``etp_size``), as :class:`ParamInfo` states.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from megarl.checkpoint.hf_io import HFCheckpointReader
from megarl.models.mapping import (Entry, ModelLayout, TPSplit, global_name, hf_names_for, lookup,
                                       split_tp, to_megatron)


@dataclass(frozen=True)
class ParamInfo:
    """How one local Megatron parameter relates to the full, global one."""

    global_name: str
    """Checkpoint-style name with global layer / expert indices."""
    entry: Entry
    """Its mapping-table row (HF names, transform)."""
    tp_split: TPSplit
    """How this rank's module splits the full tensor over the (expert) tensor-parallel group: the
    table's split, or ``NONE`` for a Transformer Engine duplicated linear (``naming.is_duplicated``)."""
    expert: bool
    """True: split over the expert-TP group (ETP) and placed by EP; False: over the TP group."""


def _layer_numbers(chunk) -> dict[int, int]:
    """Local layer index in a chunk -> Megatron's global 1-based ``layer_number``."""
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    return {i: layer.layer_number for i, layer in enumerate(layers)}


def iter_global_params(model_chunks: Sequence[torch.nn.Module], parallel_state, layout: ModelLayout,
                       table=None) -> Iterator[tuple[ParamInfo, torch.nn.Parameter]]:
    """Every parameter of this rank's chunks with its :class:`ParamInfo`.

    Names are canonical (:mod:`megarl.models.naming`) under either layer spec.

    Args:
        model_chunks: the rank's ``GPTModel`` chunks (optionally wrapped: ``.module`` is unwrapped).
        parallel_state: this rank's :class:`megarl.training.parallel_state.ParallelState`.
        layout: the model's :class:`ModelLayout`.

    Raises:
        KeyError: a parameter without a mapping.
    """
    from megarl.models.mapping import family_table
    from megarl.models.naming import is_duplicated

    table = table if table is not None else family_table(layout)
    num_local_experts = max(layout.num_experts // parallel_state.ep_size, 1)
    for chunk in model_chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        numbers = _layer_numbers(chunk)
        for name, param in chunk.named_parameters():
            local_layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            gname = global_name(name, layer_number=numbers.get(local_layer),
                                ep_rank=parallel_state.ep_rank, num_local_experts=num_local_experts)
            entry, _ = lookup(table, gname)
            owner = chunk.get_submodule(name.rpartition(".")[0])
            split = TPSplit.NONE if is_duplicated(owner) else entry.tp_split
            yield ParamInfo(gname, entry, split, entry.expert), param


def iter_sync_params(model_chunks: Sequence[torch.nn.Module], parallel_state,
                     layout: ModelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters in the canonical names *and* canonical TP layout, for weight sync.

    The canonical layout is the mapping table's split: a parameter that this rank's module holds
    whole although the table splits it (Transformer Engine's duplicated MLA down projections) is
    given as its TP shard (a view, no copy), so the weight-sync plan is the same for both specs.

    Yields:
        ``(canonical global name, tensor)``: the parameter itself or a view of its TP shard.

    Raises:
        KeyError: a parameter without a mapping.
    """
    for info, param in iter_global_params(model_chunks, parallel_state, layout):
        if info.tp_split is not info.entry.tp_split:
            rank, size = ((parallel_state.etp_rank, parallel_state.etp_size) if info.expert
                          else (parallel_state.tp_rank, parallel_state.tp_size))
            yield info.global_name, split_tp(param, info.entry.tp_split, rank, size)
        else:
            yield info.global_name, param


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
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config

    from megarl.checkpoint.config_check import check_weights_match_config

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
    local = split_tp(to_megatron(info.entry, tensors, layout), info.tp_split, rank, size)
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
