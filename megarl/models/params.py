"""A rank's Megatron parameters under their global, canonical names, with how each is sharded
(used by the HF loader, the converters, the trainer's weight sync).

Sharding: a parameter of expert ``E`` lives on EP rank ``E // num_local_experts``; non-expert
parameters are split over the tensor-parallel group (``tp_rank``/``tp_size``), expert parameters
over the expert tensor-parallel group (``etp_rank``/``etp_size``), as :class:`ParamInfo` states.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megarl.models.mapping import Entry, ModelLayout, TPSplit, family_table, global_name, lookup, split_tp
from megarl.models.naming import is_duplicated


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
    table = table if table is not None else family_table(layout)
    num_local_experts = max(layout.num_experts // parallel_state.ep_size, 1)
    for chunk in model_chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module  # type: ignore[assignment]  # Megatron's wrappers
        numbers = _layer_numbers(chunk)
        for name, param in chunk.named_parameters():
            local_layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            gname = global_name(name, layer_number=numbers.get(local_layer),  # type: ignore[arg-type]  # None: no layer
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
            yield info.global_name, split_tp(param, info.entry.tp_split, rank, size, layout)
        else:
            yield info.global_name, param
