"""Megatron-Core ``GPTModel`` built from a Hugging Face ``config.json``.

The architecture (layers, heads, experts, rope, ...) is read from the HF config through the model
family registry (``megarl.models.families``); the run's choices (parallelism, precision,
router dtype, aux loss, dispatcher, dropout) come from megarl's config. Specs: Megatron's local
spec on CPU (torch norms, SequentialMLP experts), the Transformer Engine spec on GPU; a family whose
layers Megatron's GPT block spec cannot express builds its own (``Family.block_spec``,
:func:`decoder_block_spec`), so this module names no family and no attention variant.

``build_model`` needs Megatron's parallel state (``megarl.training.parallel_state``) and returns
one model chunk per virtual pipeline stage (a single chunk without interleaving).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from megarl.config.model_rules import num_experts_of
from megarl.config.parallel import model_split_issues
from megarl.config.schema import ModelConfig, ParallelConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_hf_config(hf_config_or_path: Any):
    """An HF ``PretrainedConfig`` (read through ``AutoConfig``, which accepts the transformers 4
    and 5 spellings) from a directory, or the config object itself."""
    if isinstance(hf_config_or_path, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(hf_config_or_path))
    return hf_config_or_path


def _spec_backend(device: str, spec: str) -> bool:
    """True = Transformer Engine spec."""
    if spec == "auto":
        if device != "cuda":
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return False
        return True
    if spec not in ("local", "te"):
        raise ValueError(f"spec={spec!r}: expected 'auto', 'local' or 'te'")
    if spec == "te" and device != "cuda":
        raise ValueError("spec='te' (Transformer Engine) needs device='cuda'")
    return spec == "te"


def _has_te_spec(family, hf_config, spec: str) -> bool:
    """False for a family megarl builds on the local spec only (``Family.local_spec_only``:
    ``spec='auto'`` then takes the local spec on CUDA too).

    Raises:
        ValueError: ``spec='te'`` for such a family (its reason).
    """
    if family.local_spec_only is None:
        return True
    if spec == "te":
        raise ValueError(f"spec='te': {hf_config.model_type}'s {family.local_spec_only}; use 'local'")
    return False


def build_transformer_config(hf_config, parallel_cfg: ParallelConfig, model_cfg: ModelConfig, *,
                             precision: str = "fp32", device: str = "cpu", use_te: bool = False,
                             extra_config: dict | None = None):
    """Megatron ``TransformerConfig`` for an HF model, a parallel layout and megarl's model section.

    Args:
        hf_config: HF config object or directory.
        parallel_cfg / model_cfg: megarl config sections.
        precision: ``fp32``, ``bf16`` or ``fp16`` (parameters and compute).
        device: ``cpu``, ``cuda`` or ``meta`` (meta: no memory, used by the converters).
        use_te: the Transformer Engine spec is used (enables grouped GEMM by default).
        extra_config: further ``TransformerConfig`` fields (e.g. FP8, ``calculate_per_token_loss``),
            applied before ``model.megatron_overrides`` (which are applied last).

    Fusions follow :func:`fusion_settings` (on under the TE spec, off on the local spec).

    Raises:
        ValueError: unknown precision, layers not divisible over pipeline stages, MoE with TP > 1
            without sequence parallelism, or an unsupported HF architecture (names the field).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megarl.models.families import get_family

    hf_config = load_hf_config(hf_config)
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {list(_DTYPES)}")
    family = get_family(hf_config)
    arch = family.architecture(hf_config)
    p = parallel_cfg
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    is_moe = any(arch["moe_layers"])
    num_experts = num_experts_of(hf_config) if is_moe else 0
    for key, message in model_split_issues(p, num_layers=arch["num_hidden_layers"], num_experts=num_experts):
        raise ValueError(f"{key}: {message}")  # the rules megarl validate reports (megarl.config.parallel)
    kwargs = family.transformer_config_kwargs(arch)
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if is_moe and kwargs.get("add_bias_linear") and etp != 1:  # Megatron-Core 0.16.1 asserts it (transformer_config.py)
        raise ValueError(f"parallel.expert_tensor_parallel_size: {etp} (it defaults to TP); {hf_config.model_type}'s "
                         "experts have biases, which Megatron-Core supports only at expert TP 1")
    kwargs.update(_layout_kwargs(p, model_cfg, first=first, last=last, precision=precision, device=device))
    kwargs.update(_feature_kwargs(model_cfg, is_moe=is_moe, use_te=use_te,
                                  multi_latent_attention=bool(kwargs.get("multi_latent_attention"))))
    kwargs.update(extra_config or {})
    config_overrides, _ = split_megatron_overrides(model_cfg.megatron_overrides or {})
    kwargs.update(config_overrides)  # the user's Megatron fields win over every choice above
    # Multi-latent attention (DeepSeek-V3) needs Megatron's MLA config class (q/kv LoRA ranks, YaRN).
    config_class = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    # GPTModel(position_embedding_type="yarn") reads yarn_* attributes that only exist as attributes
    # (Megatron-Core 0.16.1 gpt_model.py): gpt-oss's YaRN without MLA.
    yarn = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("yarn_")]}
    config = config_class(**kwargs)
    for key, value in yarn.items():
        setattr(config, key, value)
    return config


def _layout_kwargs(p: ParallelConfig, model_cfg: ModelConfig, *, first: int | None, last: int | None,
                   precision: str, device: str) -> dict:
    """``TransformerConfig`` fields of the parallel layout (``first`` / ``last``: layers of the first /
    last pipeline stage, None: even), the precision, dropout and initialisation on ``device``."""
    dtype = _DTYPES[precision]
    return dict(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        context_parallel_size=p.context_parallel_size, sequence_parallel=p.sequence_parallel,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=precision == "bf16", fp16=precision == "fp16",
        hidden_dropout=model_cfg.hidden_dropout, attention_dropout=model_cfg.attention_dropout,
        use_cpu_initialization=device != "cuda", perform_initialization=device != "meta",
        masked_softmax_fusion=False)  # local attention's fused softmax (apex); TE attention fuses its own


def _feature_kwargs(model_cfg: ModelConfig, *, is_moe: bool, use_te: bool, multi_latent_attention: bool) -> dict:
    """``TransformerConfig`` fields of the fusions (:func:`fusion_settings`), activation recomputation
    (``model.recompute_granularity``) and, for an MoE model, the router and token dispatcher.

    Raises:
        ValueError: ``model.moe_grouped_gemm=True`` without the Transformer Engine spec.
    """
    kwargs, _ = fusion_settings(use_te=use_te, is_moe=is_moe, multi_latent_attention=multi_latent_attention,
                                grad_accum_kernel=_grad_accum_kernel_available())
    if model_cfg.recompute_granularity is not None:
        kwargs.update(recompute_granularity=model_cfg.recompute_granularity)
        if model_cfg.recompute_granularity == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if is_moe:
        grouped = model_cfg.moe_grouped_gemm if model_cfg.moe_grouped_gemm is not None else use_te
        if grouped and not use_te:
            raise ValueError("model.moe_grouped_gemm=True needs the Transformer Engine spec (GPU)")
        kwargs.update(
            moe_router_dtype=model_cfg.moe_router_dtype, moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if model_cfg.moe_aux_loss_coeff > 0 else "none",
            moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type, moe_grouped_gemm=grouped)
    return kwargs


FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "moe_permute_fusion", "persist_layer_norm")
"""Megatron-Core fusions megarl sets (``TransformerConfig`` fields, all default False in Megatron-Core)."""


def _grad_accum_kernel_available() -> bool:
    """Megatron's local linears (the output layer, even under the TE spec) need apex's
    ``fused_weight_gradient_mlp_cuda`` for ``gradient_accumulation_fusion`` (``tensor_parallel/layers.py``
    raises at construction without it)."""
    try:
        from megatron.core.tensor_parallel import layers
    except ImportError:
        return False
    return bool(getattr(layers, "_grad_accum_fusion_available", False))


def fusion_settings(*, use_te: bool, is_moe: bool, multi_latent_attention: bool,
                    grad_accum_kernel: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Megatron's fusions for a layer spec, as Megatron-LM runs them on GPU: every one of
    :data:`FUSIONS` on under the Transformer Engine spec, off on the local spec (CPU), with the reason
    for each one left off.

    Args:
        use_te: the TE layer spec is used (CUDA).
        is_moe: the model has experts (``moe_permute_fusion``: TE's fused permute, TE >= 2.1).
        multi_latent_attention: MLA (Megatron-Core 0.16.1 marks RoPE fusion for MLA experimental,
            training-only, so it stays off).
        grad_accum_kernel: apex's ``fused_weight_gradient_mlp_cuda`` is importable (needed by the
            local output layer; TE linears accumulate into ``main_grad`` themselves).

    Returns:
        ``({field: bool}, {field: why it is off})``; ``model.megatron_overrides`` can change any of them.
    """
    if not use_te:
        why = "local layer spec (CPU): the fused kernels are CUDA-only (Transformer Engine / apex)"
        return {name: False for name in FUSIONS}, {name: why for name in FUSIONS}
    on = {name: True for name in FUSIONS}
    off = {}
    if not grad_accum_kernel:
        off["gradient_accumulation_fusion"] = "apex fused_weight_gradient_mlp_cuda is not installed"
    if multi_latent_attention:
        off["apply_rope_fusion"] = "RoPE fusion for MLA is experimental and training-only in Megatron-Core 0.16.1"
    if not is_moe:
        off["moe_permute_fusion"] = "dense model"
    on.update({name: False for name in off})
    return on, off


def split_megatron_overrides(overrides: dict) -> tuple[dict, dict]:
    """``model.megatron_overrides`` split into ``TransformerConfig`` and ``DistributedDataParallelConfig`` fields.

    A name both dataclasses have goes to both. MLA fields (``MLATransformerConfig``) count as
    ``TransformerConfig`` fields.

    Raises:
        ValueError: a name neither dataclass has (names it).
    """
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config_fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    unknown = sorted(set(overrides) - config_fields - ddp_fields)
    if unknown:
        raise ValueError(f"model.megatron_overrides.{unknown[0]}: not a field of Megatron-Core's TransformerConfig "
                         f"or DistributedDataParallelConfig (unknown: {unknown})")
    return ({k: v for k, v in overrides.items() if k in config_fields},
            {k: v for k, v in overrides.items() if k in ddp_fields})


def build_model(hf_config, parallel_cfg: ParallelConfig, model_cfg: ModelConfig, *,
                precision: str = "fp32", device: str | None = None, spec: str = "auto",
                extra_config: dict | None = None) -> list:
    """Build this rank's ``GPTModel`` chunks (one per virtual pipeline stage).

    Pre/post-processing (embedding / output layer) follows the rank's pipeline stage and each
    chunk's virtual stage. The vocabulary is padded to a multiple of
    ``model.make_vocab_size_divisible_by x TP`` (padded rows are zero after
    :func:`megarl.conversion.load_hf.load_hf_weights`). Weights are randomly initialised; load HF weights
    with ``load_hf_weights``. ``model.moe_router_freeze`` sets ``requires_grad=False`` on routers.

    Args:
        hf_config: HF config object or directory.
        parallel_cfg / model_cfg: megarl config sections (must match the initialised parallel state).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        device: ``cpu``, ``cuda``, or ``meta`` (shapes only); None = cuda when available.
        spec: ``auto`` (TE on CUDA when importable, local otherwise), ``local`` or ``te``.
        extra_config: extra ``TransformerConfig`` fields (see :func:`build_transformer_config`).

    Returns:
        ``list[GPTModel]``: the model chunks, on ``device``, in training mode.

    Raises:
        ValueError: see :func:`build_transformer_config`; context parallelism without the TE spec.
        RuntimeError: parallel state not initialised.
    """
    from megatron.core import parallel_state as mps

    from megarl.models.families import get_family
    from megarl.models.mapping import padded_vocab_size

    if not mps.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron's parallel state: call initialize_parallel() first")
    hf_config = load_hf_config(hf_config)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    family = get_family(hf_config)
    use_te = _spec_backend("cuda" if device == "cuda" else "cpu", spec) and _has_te_spec(family, hf_config, spec)
    if parallel_cfg.context_parallel_size > 1 and not use_te and device != "meta":
        raise ValueError(f"parallel.context_parallel_size={parallel_cfg.context_parallel_size} needs the Transformer "
                         "Engine layer spec on CUDA (Megatron-Core's local attention supports 1 only)")
    config = build_transformer_config(hf_config, parallel_cfg, model_cfg, precision=precision,
                                      device=device, use_te=use_te, extra_config=extra_config)
    gpt_kwargs = family.gpt_model_kwargs(family.architecture(hf_config))
    vocab = padded_vocab_size(family.text(hf_config).vocab_size, model_cfg.make_vocab_size_divisible_by,
                              parallel_cfg.tensor_model_parallel_size)
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in (range(vpp) if vpp else [None]):
        model = _build_chunk(config, decoder_block_spec(family, config, use_te=use_te, vp_stage=vp_stage), vp_stage,
                             vocab_size=vocab, device=device, gpt_kwargs=gpt_kwargs)
        _mapped_buffers_to_parameters(model, family.table)
        if model_cfg.moe_router_freeze:
            for name, param in model.named_parameters():
                if name.endswith("mlp.router.weight"):
                    param.requires_grad_(False)
        chunks.append(model)
    return chunks


def decoder_block_spec(family, config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """The decoder block spec (``TransformerBlockSubmodules``) of ``family``'s model on this rank
    (``pp_rank`` None: from Megatron's parallel state): the family's own builder where it has one
    (``Family.block_spec``, an import path), else Megatron-Core's GPT block spec (RMSNorm); then, on
    the local spec, megarl's local attention for every family: MLA's (Megatron-Core 0.16.1's local
    MLA spec cannot build) and fused SDPA per packed sequence in every other self-attention.

    Raises:
        megarl.plugins.PluginError: the family's ``block_spec`` does not resolve (names it).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarl.plugins import load_object

    if family.block_spec is None:
        block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                                vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        build = load_object(family.block_spec, f"Family({family.name!r}).block_spec")
        block_spec = build(config, use_te=use_te, vp_stage=vp_stage, pp_rank=pp_rank)
    if config.multi_latent_attention and not use_te:
        from megarl.training.local_mla import use_local_mla_attention

        use_local_mla_attention(block_spec)
    if not use_te:
        from megarl.training.local_attention import use_local_sdpa_attention

        use_local_sdpa_attention(block_spec)  # fused SDPA per packed sequence instead of dense scores
    return block_spec


def _build_chunk(config, block_spec, vp_stage: int | None, *, vocab_size: int, device: str,
                 gpt_kwargs: dict) -> torch.nn.Module:
    """One ``GPTModel`` chunk (virtual pipeline stage ``vp_stage``, None without VPP) of this rank, on
    ``device``, from its :func:`decoder_block_spec`."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel

    ctx = torch.device("meta") if device == "meta" else contextlib.nullcontext()
    with ctx:
        model = GPTModel(
            config=config, transformer_layer_spec=block_spec, vocab_size=vocab_size,
            pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, **gpt_kwargs)
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    elif device == "meta":  # softmax_offset (learnable sinks) is made on an explicit device, not meta
        for module in model.modules():
            if any(not p.is_meta for p in module.parameters(recurse=False)):
                module._apply(lambda t: t.to("meta"), recurse=False)
    return model


def _mapped_buffers_to_parameters(model: torch.nn.Module, table) -> None:
    """Re-register the persistent buffers that the family maps to HF tensors as frozen parameters.

    Megatron's ``TopKRouter`` keeps ``expert_bias`` (HF ``e_score_correction_bias``) in a buffer,
    while megarl's loader, converters and weight sync enumerate parameters. As a parameter with
    ``requires_grad=False`` it keeps its state-dict key, dtype (fp32) and role: Megatron only reads
    it in routing and updates it in place when ``moe_router_bias_update_rate > 0``; it gets no
    gradient and no optimizer state. It moves to the device of its module's parameters (``meta``
    for the converters' shape-only models).
    """
    from megarl.models.mapping import template_of

    for prefix, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if template_of(f"{prefix}.{name}" if prefix else name)[0] not in table:
                continue
            device = next(module.parameters(recurse=False), buffer).device
            del module._buffers[name]
            module.register_parameter(name, torch.nn.Parameter(buffer.to(device), requires_grad=False))
