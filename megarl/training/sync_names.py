"""This rank's Megatron parameter shards under model-global names, for weight sync and export.

Megatron names parameters locally: a pipeline stage numbers its layers from 0, and an
expert-parallel rank numbers its experts from 0. `named_parameters_for_sync` renames both to
global indices, so a name means the same tensor on every rank and layout:

    decoder.layers.{local_layer}.            -> decoder.layers.{layer_number - 1}.
    mlp.experts.local_experts.{j}.           -> mlp.experts.local_experts.{ep_rank * E_local + j}.
    mlp.experts.linear_fc{1,2}.weight{j}     -> ...weight{ep_rank * E_local + j}   (grouped GEMM)

The tensor stays this rank's shard (its TP / ETP slice; Megatron's ``tensor_model_parallel`` and
``partition_dim`` attributes on the parameter say how it is split). Names carry no virtual-pipeline
chunk prefix: layer numbers are already global.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import torch

from megarl.training.parallel_state import ParallelState

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return chunk.module if hasattr(chunk, "module") else chunk


def named_parameters_for_sync(model_chunks: Sequence[torch.nn.Module], parallel: ParallelState
                              ) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield ``(global_name, parameter)`` for every parameter of this rank's model chunks.

    Args:
        model_chunks: the (DDP-wrapped) ``GPTModel`` chunks of this rank.
        parallel: this rank's parallel state (``ep_rank`` / ``ep_size`` for expert numbering).

    Yields:
        The parameter itself (not a copy): the current weights, sharded as Megatron holds them.
    """
    for chunk in model_chunks:
        model = _unwrap(chunk)
        num_experts = getattr(model.config, "num_moe_experts", None) or 0
        expert_offset = parallel.ep_rank * (num_experts // parallel.ep_size) if num_experts else 0
        layers = getattr(getattr(model, "decoder", None), "layers", [])
        global_layer = {local: layer.layer_number - 1 for local, layer in enumerate(layers)}
        for name, param in model.named_parameters():
            match = _LAYER.match(name)
            if match:
                name = f"decoder.layers.{global_layer[int(match.group(1))]}." + name[match.end():]
            name = _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)
            name = _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name)
            yield name, param
