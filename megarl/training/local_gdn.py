"""Gated DeltaNet and zero-centred RMSNorm for the local (CPU) layer spec: Qwen3.5-MoE's hybrid layers.

Megatron-Core 0.16.1 has the pieces but not on CPU: ``GatedDeltaNet`` raises ImportError without
the ``fla`` package (``megatron/core/ssm/gated_delta_net.py`` line 103) and makes its conv and
``dt_bias`` / ``A_log`` on ``torch.cuda.current_device()`` (lines 173-196); the hybrid block spec
(``models/gpt/experimental_attention_variant_module_specs.py`` ``_get_backend_spec_provider``)
asserts the Transformer Engine implementation; the local spec's norm, ``WrappedTorchNorm``, refuses
``layernorm_zero_centered_gamma`` (``transformer/torch_norm.py`` line 27); and ``GatedDeltaNet``
ignores the attention mask (line 280, "TODO"; THD ``packed_seq_params`` raise, line 297), so
sequences packed in one row would leak state.

:class:`LocalGatedDeltaNet` subclasses ``GatedDeltaNet``: the same parameters, names and
``sharded_state_dict`` (dist checkpoints are interchangeable with the TE spec's), built on the
configured device, and a forward in plain torch per packed sequence: Megatron's
``torch_chunk_gated_delta_rule`` (its deterministic-mode fallback, from transformers' Qwen3-Next)
after an L2 norm of q/k (``x / sqrt(sum x^2 + 1e-6)``, fla's and transformers' ``l2norm``).
:func:`local_hybrid_block_spec` builds the block.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, torch_chunk_gated_delta_rule
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from megarl.training.local_attention import _segments_of


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gain, ``y = x / sqrt(mean(x^2) + eps) * (1 + w)``, computed in fp32
    and cast back (transformers' ``Qwen3_5MoeRMSNorm``; Megatron's ``layernorm_zero_centered_gamma``).
    Constructor as Megatron's norms: ``(config, hidden_size, eps)``; ``weight [hidden_size]`` starts at 0."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # Megatron reads it (SP grad all-reduce)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., hidden_size]`` -> same shape and dtype."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GainRMSNorm(torch.nn.Module):
    """The DeltaNet's per-head output norm: ``weight * (x / sqrt(mean(x^2) + eps))`` (not zero-centred,
    transformers' ``Qwen3_5MoeRMSNormGated`` before its gate); ``weight [hidden_size]`` starts at 1.
    Constructor as Megatron's norms; forward ``x [..., hidden_size]`` -> same shape and dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``weight * rmsnorm(x)``, the norm in fp32, the product in ``x``'s dtype."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class LocalGatedDeltaNet(GatedDeltaNet):
    """Megatron-Core 0.16.1's ``GatedDeltaNet`` without ``fla`` or CUDA (see the module docstring).

    Forward: ``hidden_states [s / sp, b, h]`` (sequence-parallel shard when SP), ``attention_mask``
    ``[b or 1, 1, s, s]`` bool, block-diagonal causal for packed rows (each sequence its own
    recurrence) or None (one sequence per row); returns ``(out [s / sp, b, h], bias)``.
    """

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int | None = None,
                 pg_collection=None, **_):
        MegatronModule.__init__(self, config)
        if pg_collection is None:
            raise ValueError("LocalGatedDeltaNet needs pg_collection (Megatron passes the layer's)")
        self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, False, False, None
        self.A_init_range, self.use_qk_l2norm, self.pg_collection = (1, 16), True, pg_collection
        self.tp_size = pg_collection.tp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.hidden_size, self.act_fn = config.hidden_size, config.activation_func
        self.activation = self.act_fn.__name__
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.in_proj = build_module(submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config,
                                    init_method=config.init_method, gather_output=False, bias=False,
                                    skip_bias_add=False, is_expert=False, tp_group=pg_collection.tp)
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.conv1d = torch.nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp, bias=False,
                                      kernel_size=self.conv_kernel_dim, groups=self.conv_dim_local_tp,
                                      padding=self.conv_kernel_dim - 1, device=device, dtype=config.params_dtype)
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        heads = dict(size=(self.num_v_heads_local_tp,), dtype=config.params_dtype, device=device)
        self.dt_bias = torch.nn.Parameter(torch.ones(**heads))
        self.A_log = torch.nn.Parameter(torch.empty(**heads))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            param.tensor_model_parallel = True  # type: ignore[attr-defined]  # Megatron reads it
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(submodules.out_proj, self.v_dim, self.hidden_size, config=config,
                                     init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                     skip_bias_add=True, is_expert=False, tp_group=pg_collection.tp)
        if config.perform_initialization:
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs):
        """One DeltaNet layer (shapes in the class docstring).

        Raises:
            NotImplementedError: inference caches or THD ``packed_seq_params`` (as Megatron's).
        """
        if kwargs.get("inference_context") is not None or kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError("LocalGatedDeltaNet: no inference cache or THD packed_seq_params")
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp] (gathered over SP)
        seq_len = qkvzba.shape[0]
        segments = _segments_of(attention_mask) if attention_mask is not None else None
        if segments is None:
            segments = [[seq_len]]
        if len(segments) == 1 and qkvzba.shape[1] > 1:
            segments = segments * qkvzba.shape[1]
        rows = []
        for r, lens in enumerate(segments):
            start, pieces = 0, []
            for n in lens:
                pieces.append(self._sequence(qkvzba[start:start + n, r]))
                start += n
            rows.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        out, out_bias = self.out_proj(torch.stack(rows, dim=1))
        return out, out_bias

    def _sequence(self, x: Tensor) -> Tensor:
        """One sequence: ``in_proj`` output ``[n, in_proj_dim / tp]`` -> gated norm output ``[n, V / tp]``."""
        n, tp = x.shape[0], self.tp_size
        heads = self.num_value_heads // tp
        qkv, gate, beta, alpha = torch.split(x, [self.conv_dim_local_tp, self.v_dim // tp, heads, heads], dim=-1)
        qkv = self.act_fn(self.conv1d(qkv.t().unsqueeze(0))[..., :n])[0].t()  # causal depthwise conv
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query, key = (_l2norm(t.reshape(1, n, -1, self.key_head_dim)) for t in (query, key))
        value = value.reshape(1, n, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # [n, heads / tp]
        core, _ = torch_chunk_gated_delta_rule(query, key, value, g=g.unsqueeze(0), beta=beta.sigmoid().unsqueeze(0))
        y = self.out_norm(core.reshape(n, -1, self.value_head_dim))
        y = y * self.act_fn(gate.reshape(n, -1, self.value_head_dim).float())
        return y.to(x.dtype).reshape(n, -1)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_net_spec() -> ModuleSpec:
    """The local spec of a DeltaNet layer's mixer (``self_attention``)."""
    return ModuleSpec(module=LocalGatedDeltaNet,
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=GainRMSNorm,
                                                         out_proj=RowParallelLinear))


def local_hybrid_block_spec(config, vp_stage: int | None, pp_rank: int | None = None):
    """The local block spec of a gated-DeltaNet hybrid (``config.experimental_attention_variant ==
    "gated_delta_net"``, ``linear_attention_freq`` a per-layer list, 1 = DeltaNet): Megatron's local GPT
    block spec with each DeltaNet layer's ``self_attention`` replaced by :func:`gated_delta_net_spec`;
    with ``layernorm_zero_centered_gamma``, every ``WrappedTorchNorm`` (layer, q/k and final norms)
    replaced by :class:`ZeroCenteredRMSNorm`. ``pp_rank``: None = this rank's (parallel state).

    Raises:
        ValueError: ``linear_attention_freq`` is not a list with one entry per layer.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = config.linear_attention_freq
    if not isinstance(pattern, list) or len(pattern) != config.num_layers:
        raise ValueError(f"linear_attention_freq: expected a list of {config.num_layers} 0/1 entries, got {pattern!r}")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = []
    for i, layer_spec in enumerate(block.layer_specs):
        submodules = dataclasses.replace(layer_spec.submodules)
        if pattern[offset + i]:
            submodules.self_attention = gated_delta_net_spec()
        layers.append(dataclasses.replace(layer_spec, submodules=submodules))
    block = dataclasses.replace(block, layer_specs=layers)
    if config.layernorm_zero_centered_gamma:
        _zero_centered_norms(block)
    return block


def te_hybrid_block_spec(config, vp_stage: int | None, pp_rank: int | None = None):
    """Megatron-Core 0.16.1's Transformer Engine block spec of a gated-DeltaNet hybrid
    (``get_transformer_block_with_experimental_attention_variant_spec``) with each DeltaNet's
    ``out_norm`` replaced by :class:`GainRMSNorm`: Megatron's is a ``TENorm``, which follows
    ``layernorm_zero_centered_gamma`` (``extensions/transformer_engine.py`` line 461, ``TENorm``) and would compute
    ``(1 + w) * x``, while the checkpoint's gated norm multiplies by ``w``. Needs Transformer Engine
    and, to build the layers, ``fla`` (Megatron's ``GatedDeltaNet``)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec as hybrid_spec,
    )

    block = hybrid_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    for layer_spec in block.layer_specs:
        mixer = layer_spec.submodules.self_attention
        if getattr(mixer, "module", None) is GatedDeltaNet:
            mixer.submodules = dataclasses.replace(mixer.submodules, out_norm=GainRMSNorm)
    return block


def _zero_centered_norms(block) -> None:
    """Put :class:`ZeroCenteredRMSNorm` where the local spec has ``WrappedTorchNorm`` (in place)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if block.layer_norm is WrappedTorchNorm:
        block.layer_norm = ZeroCenteredRMSNorm
    for layer_spec in block.layer_specs:
        for owner in (layer_spec.submodules, getattr(layer_spec.submodules.self_attention, "submodules", None)):
            for field in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
                if owner is not None and getattr(owner, field, None) is WrappedTorchNorm:
                    setattr(owner, field, ZeroCenteredRMSNorm)


def hybrid_block_spec(config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """Qwen3.5's ``Family.block_spec``: :func:`te_hybrid_block_spec` under Transformer Engine, else
    :func:`local_hybrid_block_spec` (arguments as theirs)."""
    return (te_hybrid_block_spec if use_te else local_hybrid_block_spec)(config, vp_stage, pp_rank)
