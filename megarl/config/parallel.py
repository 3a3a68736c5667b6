"""The parallel layout's rules, written once: ``megarl validate`` reports them all with their keys,
and the trainer raises the first (:func:`megarl.training.parallel_state.check_parallel_sizes`,
:func:`megarl.training.model.build_transformer_config`).

Each function returns ``(key, message)`` pairs, empty when the layout is valid.
"""
from __future__ import annotations

from typing import Any


def trainer_world_size(cluster: Any) -> int:
    """Number of trainer ranks: ``trainer_nodes * trainer_devices_per_node`` of the ``cluster`` section."""
    return int(cluster.trainer_nodes) * int(cluster.trainer_devices_per_node)


def parallel_size_issues(p: Any, world_size: int, world: str) -> list[tuple[str, str]]:
    """The ``parallel`` sizes against the trainer world size (Megatron's ``initialize_model_parallel``).

    Args:
        p: the ``parallel`` section.
        world_size: trainer ranks.
        world: how the message names the world size (``cluster.trainer_nodes*... = 4``).
    """
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    mp = tp * pp * cp
    issues = []
    if p.virtual_pipeline_model_parallel_size is not None and pp <= 1:
        issues.append(("parallel.virtual_pipeline_model_parallel_size",
                       "interleaving needs pipeline_model_parallel_size > 1 (or null)"))
    if mp <= 0 or world_size % mp:
        issues.append(("parallel.tensor_model_parallel_size",
                       f"TP*PP*CP = {tp}*{pp}*{cp} = {mp} must divide the trainer world size {world}"))
    if world_size % (etp * ep * pp):
        issues.append(("parallel.expert_model_parallel_size",
                       f"ETP*EP*PP = parallel.expert_tensor_parallel_size ({etp}"
                       f"{' = TP' if p.expert_tensor_parallel_size is None else ''}) x expert_model_parallel_size "
                       f"({ep}) x pipeline_model_parallel_size ({pp}) must divide the trainer world size {world}"
                       + (f" (expert_tensor_parallel_size defaults to TP={tp}; set it to 1 for TP>1 with EP>1 on few "
                          "ranks)" if p.expert_tensor_parallel_size is None else "")))
    if p.sequence_parallel and tp <= 1:
        issues.append(("parallel.sequence_parallel", "sequence parallelism needs tensor_model_parallel_size > 1"))
    return issues


def model_split_issues(p: Any, *, num_layers: int, num_experts: int) -> list[tuple[str, str]]:
    """The model's layers and experts (from its ``config.json``) over the parallel layout.

    Args:
        p: the ``parallel`` section.
        num_layers: ``num_hidden_layers``.
        num_experts: routed experts per MoE layer (0: a dense model).
    """
    issues = []
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    chunks = pp * (p.virtual_pipeline_model_parallel_size or 1)
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        if num_layers % chunks:
            issues.append(("parallel.pipeline_model_parallel_size",
                           f"num_hidden_layers={num_layers} (config.json) is not divisible by PP*VPP = {chunks} "
                           "(or set parallel.num_layers_in_first/last_pipeline_stage)"))
    else:
        error = uneven_stage_error(p, num_layers)
        if error:
            issues.append(("parallel.num_layers_in_first_pipeline_stage", error))
    ep = p.expert_model_parallel_size
    if num_experts:
        if num_experts % ep:
            issues.append(("parallel.expert_model_parallel_size",
                           f"num_moe_experts={num_experts} (config.json) must be divisible by EP"))
        if tp > 1 and not p.sequence_parallel:
            issues.append(("parallel.sequence_parallel", "Megatron requires sequence_parallel=True for MoE models "
                           "with tensor_model_parallel_size > 1"))
    elif ep != 1 or (p.expert_tensor_parallel_size or 1) > 1:
        issues.append(("parallel.expert_model_parallel_size",
                       "the model has no experts: use 1 (and expert_tensor_parallel_size null or 1)"))
    return issues


def uneven_stage_error(p: Any, num_layers: int) -> str | None:
    """Why ``parallel.num_layers_in_first/last_pipeline_stage`` cannot split ``num_layers`` by
    Megatron's own rule (each set stage >= 1 layer; middle stages exist exactly when layers are left
    for them), or None. Where the layers then go is the weight-sync layout's
    (:meth:`megarl.weight_sync.layout.TrainerLayout.layer_location`), checked by the preflight."""
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            return f"num_layers_in_{name}_pipeline_stage must be >= 1"
    middle_stages = p.pipeline_model_parallel_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages > 0) != (middle_layers > 0):  # Megatron's own rule
        return (f"first/last stage layers ({first}, {last}) leave {middle_layers} of num_hidden_layers="
                f"{num_layers} (config.json) for {max(middle_stages, 0)} middle pipeline stages")
    return None
