"""Model families: one module each, registered by HF ``model_type``.

A family module defines ``FAMILY = Family(...)``: its HF ``model_type`` names, the architecture
summary read from an HF config (also used by the config mismatch check), the Megatron
``TransformerConfig`` / ``GPTModel`` arguments, and the HF <-> Megatron mapping table.
Adding a family (DeepSeek-V3, GLM-4.5, ...) = a new module listed in ``_MODULES`` plus its tests.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from megarl.models.table import Entry, ModelLayout

_MODULES = ("megarl.models.families.qwen3_moe", "megarl.models.families.qwen3",
            "megarl.models.families.deepseek_v3", "megarl.models.families.glm4_moe")


@dataclass(frozen=True)
class Family:
    """Everything megarl needs to know about one model family."""

    name: str
    model_types: tuple[str, ...]
    """HF ``config.model_type`` values handled by this family."""
    table: Mapping[str, Entry]
    """Megatron name template -> :class:`Entry` (local and Transformer Engine spec names)."""
    architecture: Callable[[Any], dict]
    """HF config -> canonical architecture fields (both HF spellings give the same dict)."""
    transformer_config_kwargs: Callable[[dict], dict]
    """Architecture dict -> ``TransformerConfig`` keyword arguments (architecture only)."""
    gpt_model_kwargs: Callable[[dict], dict]
    """Architecture dict -> extra ``GPTModel`` keyword arguments (rope, tied embeddings)."""
    megatron_shapes: Callable[[dict], dict]
    """Architecture dict -> {global Megatron name (local spec): full unpadded shape}."""
    engine_load_groups: tuple[tuple[str, ...], ...] = ()
    """HF tensor name templates (``{L}`` = layer) that the rollout engine's SGLang loader must see
    in one ``load_weights`` call: it caches one member and loads only when the others arrive within
    that same call, so a member sent alone is silently never loaded. Weight sync keeps each group
    (per layer) in one bucket (:func:`megarl.weight_sync.plan.build_plan`). A member absent from a
    model (no ``q_lora_rank``: no ``q_a_proj``) just leaves a smaller group. Each family cites the
    SGLang 0.5.23 source it read; () = its loader loads every tensor on its own."""

    def layout(self, hf_config, *, make_vocab_size_divisible_by: int = 128, tp_size: int = 1) -> ModelLayout:
        """The :class:`ModelLayout` of an HF config for a given TP size."""
        from megarl.models.table import padded_vocab_size

        arch = self.architecture(hf_config)
        return ModelLayout(
            family=self.name, num_layers=arch["num_hidden_layers"], hidden_size=arch["hidden_size"],
            num_attention_heads=arch["num_attention_heads"], num_query_groups=arch["num_key_value_heads"],
            head_dim=arch["head_dim"], vocab_size=arch["vocab_size"],
            padded_vocab_size=padded_vocab_size(arch["vocab_size"], make_vocab_size_divisible_by, tp_size),
            num_experts=arch.get("num_experts", 0), moe_layers=tuple(arch.get("moe_layers", ())),
            tie_word_embeddings=arch["tie_word_embeddings"])


def _registry() -> dict[str, Family]:
    out = {}
    for module in _MODULES:
        family = importlib.import_module(module).FAMILY
        out[family.name] = family
        for model_type in family.model_types:
            out[model_type] = family
    return out


def get_family(name_or_config) -> Family:
    """The family for a family name, an HF ``model_type`` or an HF config object.

    Raises:
        ValueError: unsupported model type (lists the supported ones).
    """
    key = getattr(name_or_config, "model_type", name_or_config)
    registry = _registry()
    if key not in registry:
        raise ValueError(f"model_type {key!r} is not supported; supported: {sorted(registry)}")
    return registry[key]


def hf_get(hf_config, *names: str, default: Any = KeyError) -> Any:
    """The first attribute of ``names`` present in an HF config (handles both HF spellings).

    Raises:
        KeyError: none is present and no default was given.
    """
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    if default is KeyError:
        raise KeyError(f"HF config has none of {names}")
    return default


def rope_settings(hf_config) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (transformers 4)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = scaling.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), rope_type
