"""One canonical naming of Megatron parameters for both layer specs (local and Transformer Engine).

Megatron-Core builds the same model under two layer specs whose modules name some parameters
differently (``megatron/core/models/gpt/gpt_layer_specs.py``, Megatron-Core 0.16.1; Transformer
Engine 2.x parameter names from ``transformer_engine/pytorch/module/{layernorm_linear,grouped_linear,
linear,rmsnorm}.py``):

- ``TELayerNormColumnParallelLinear`` (TE ``LayerNormLinear``) fuses the norm into the following
  linear and registers ``layer_norm_weight`` (and ``layer_norm_bias`` under LayerNorm) beside
  ``weight``: the input norm of standard attention (``linear_qkv``), the pre-MLP norm of dense layers
  (``mlp.linear_fc1``; MoE layers keep a separate ``pre_mlp_layernorm`` under both specs), and MLA's
  q / kv norms (``linear_q_up_proj`` / ``linear_kv_up_proj``, when ``qk_layernorm``).
- ``TEGroupedMLP`` (``moe_grouped_gemm``) holds the local experts in two TE ``GroupedLinear``
  modules with one parameter per expert, ``linear_fc1.weight{E}`` / ``linear_fc2.weight{E}``,
  where ``SequentialMLP`` has ``local_experts.{E}.linear_fc1.weight``.

The canonical name is the local spec's: it names every norm by its own module and every expert by
its index, so it is what the families' mapping tables, the weight-sync plan
(``megarl.weight_sync.model_specs``), the trainer's sync parameters, the HF converters and megarl's
HF loads use. :func:`megarl.models.mapping.canonical_name` turns any name of either spec into it (identity on
canonical names). Megatron's own distributed checkpoints need nothing from this module: both specs write the
same ``sharded_state_dict`` keys (the local spec's ``sharded_state_dict_keys_map`` and
``TEGroupedMLP.sharded_state_dict``, which is "interchangeable with SequentialMLP's").

One layout difference goes with the names: under the TE spec MLA's down projections
(``linear_q_down_proj``, ``linear_kv_down_proj``) are ``TELinear(parallel_mode="duplicated")``,
whole on every TP rank, while the local spec's ``ColumnParallelLinear`` splits their rows
(``multi_latent_attention.py``). :func:`is_duplicated` recognises such a module; the canonical
layout is the local spec's, so a duplicated parameter is presented to weight sync as its TP shard
(:func:`megarl.models.params.iter_sync_params`).
"""
from __future__ import annotations

import torch

_L = "decoder.layers.{L}."

TE_TO_CANONICAL: dict[str, str] = {
    _L + "self_attention.linear_qkv.layer_norm_weight": _L + "input_layernorm.weight",
    _L + "self_attention.linear_qkv.layer_norm_bias": _L + "input_layernorm.bias",
    _L + "self_attention.in_proj.layer_norm_weight": _L + "input_layernorm.weight",  # gated DeltaNet
    _L + "mlp.linear_fc1.layer_norm_weight": _L + "pre_mlp_layernorm.weight",
    _L + "mlp.linear_fc1.layer_norm_bias": _L + "pre_mlp_layernorm.bias",
    _L + "self_attention.linear_q_up_proj.layer_norm_weight": _L + "self_attention.q_layernorm.weight",
    _L + "self_attention.linear_q_up_proj.layer_norm_bias": _L + "self_attention.q_layernorm.bias",
    _L + "self_attention.linear_kv_up_proj.layer_norm_weight": _L + "self_attention.kv_layernorm.weight",
    _L + "self_attention.linear_kv_up_proj.layer_norm_bias": _L + "self_attention.kv_layernorm.bias",
    _L + "mlp.experts.linear_fc1.weight{E}": _L + "mlp.experts.local_experts.{E}.linear_fc1.weight",
    _L + "mlp.experts.linear_fc1.bias{E}": _L + "mlp.experts.local_experts.{E}.linear_fc1.bias",
    _L + "mlp.experts.linear_fc2.weight{E}": _L + "mlp.experts.local_experts.{E}.linear_fc2.weight",
    _L + "mlp.experts.linear_fc2.bias{E}": _L + "mlp.experts.local_experts.{E}.linear_fc2.bias",
}
"""Transformer Engine spec name template -> canonical (local spec) template; ``{L}`` layer, ``{E}`` expert."""


def canonical_template(template: str) -> str:
    """The canonical template of a name template of either spec (identity when already canonical)."""
    return TE_TO_CANONICAL.get(template, template)


def is_duplicated(module: torch.nn.Module) -> bool:
    """True for Megatron's ``TELinear(parallel_mode="duplicated")``: the whole weight on every TP rank.

    Megatron passes ``parallel_mode=None`` to TE's ``Linear`` for a duplicated linear, which TE keeps
    as ``self.parallel_mode`` (TE ``module/linear.py``). The exact class is checked because TE also
    gets ``None`` for expert linears that Megatron shards itself (``explicit_expert_comm``), and
    those are ``TEColumnParallelLinear`` / ``TERowParallelLinear`` subclasses.
    """
    cls = type(module)
    return (cls.__name__ == "TELinear" and cls.__module__ == "megatron.core.extensions.transformer_engine"
            and getattr(module, "parallel_mode", "unknown") is None)
