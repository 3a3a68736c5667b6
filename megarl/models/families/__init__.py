"""Model families: one module each, registered by HF ``model_type``.

A family module defines ``FAMILY = Family(...)``: everything megarl knows about the family. Its HF
``model_type`` names, the architecture summary read from an HF config (also used by the config
mismatch check), the Megatron ``TransformerConfig`` / ``GPTModel`` arguments, the HF <-> Megatron
mapping table, the SGLang reasoning and tool-call parsers, the rollout engine's quirks (its class,
whether it keeps ``lm_head`` apart, its loader's fused groups) and the ``tiny:`` builder's config.
Other modules ask the family (:func:`get_family`, :func:`find_family`) and keep no per-family table.
Adding a family = a new module in this package plus its tests and fixtures: every module here whose
name does not start with ``_`` is a family module and registers by existing (:func:`discover_families`;
docs/architecture.md, "Adding a model family").
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megarl.models.table import Entry, ModelLayout

REFERENCE_FAMILY = "qwen3_moe"
"""megarl's reference family: what ``tiny:`` (no family named) builds."""


@dataclass(frozen=True)
class ParserVariant:
    """A release that shares a family's ``model_type`` but writes tool calls (or reasoning)
    differently, told apart by a text its official chat template holds."""

    name: str
    """Its name (what :func:`megarl.rollout.reasoning.family_of` returns), e.g. ``deepseek_v31``."""
    marker: str
    """Text found only in this release's chat template."""
    reasoning_parser: str | None
    tool_call_parser: str


@dataclass(frozen=True, kw_only=True)
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
    text_config: Callable[[Any], Any] | None = None
    """For a model whose HF config nests its language model's config (a vision-language release:
    Kimi-K2.5's ``text_config``), ``HF config (object or config.json dict) -> that nested config``;
    None: the config is the language model's. Read through :meth:`text`."""
    hf_prefix: str = ""
    """Prefix of the language model's tensors in the HF checkpoint (Kimi-K2.5: ``language_model.``,
    before ``model.layers.{L}.``, ``model.embed_tokens.weight`` and ``lm_head.weight``); the
    table's HF names carry it. Tensors outside it (a vision tower) are not imported."""
    engine_load_groups: tuple[tuple[str, ...], ...] = ()
    """HF tensor name templates (``{L}`` = layer) that the rollout engine's SGLang loader must see
    in one ``load_weights`` call: it caches one member and loads only when the others arrive within
    that same call, so a member sent alone is silently never loaded. Weight sync keeps each group
    (per layer) in one bucket (:func:`megarl.weight_sync.plan.build_plan`). A member absent from a
    model (no ``q_lora_rank``: no ``q_a_proj``) just leaves a smaller group. Each family cites the
    SGLang 0.5.23 source it read; () = its loader loads every tensor on its own."""
    sync_table: Mapping[str, Entry] | None = None
    """The mapping table weight sync plans with where it differs from :attr:`table` (gpt-oss: its
    experts in HF orientation, read through :attr:`sync_shard_view`); None: :attr:`table`."""
    sync_shard_view: Callable[[str, Any], Any] | None = None
    """``(global Megatron name, trainer shard) -> the shard as weight sync reads it`` (the layout of
    :attr:`sync_table`: a copy, for the parameters whose entry differs; the others unchanged; also
    applied to ``meta`` tensors for shapes). None: the shards as they are."""
    reasoning_parser: str | None
    """SGLang ``ReasoningParser`` name of the family's reasoning format (None: it writes none);
    what ``rollout.agent.reasoning_parser: auto`` selects."""
    tool_call_parser: str
    """SGLang ``FunctionCallParser`` detector name of its tool calls (``tool_call_parser: auto``)."""
    parser_variants: tuple[ParserVariant, ...] = ()
    """Releases of the same ``model_type`` whose template selects other parsers (DeepSeek-V3.1)."""
    engine_class: str
    """The SGLang 0.5.23 class serving the family, as ``module.Class``
    (``sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM``)."""
    engine_text_class: str | None = None
    """Where :attr:`engine_class` wraps the language model in another SGLang class (Kimi-K2.5's
    ``DeepseekV3ForCausalLM``), that class (it builds the ``lm_head``); None: the engine class itself."""
    engine_unties_lm_head: bool
    """True where :attr:`engine_class` builds an ``lm_head`` of its own whatever
    ``tie_word_embeddings`` says (its ``__init__`` never reads the field): a tied checkpoint is then
    served through an untied view (:mod:`megarl.rollout.engine_view`) and the engine holds a second
    vocabulary matrix (:mod:`megarl.plan.shape`). False: the class shares ``embed_tokens`` when tied.
    ``tests/unit/models/test_family_rules.py`` checks it against the installed SGLang class."""
    twin_engine_tp2: bool = False
    """True where SGLang 0.5.23's CPU engine at TP 2 serves the family's ``tiny:`` model and loads megarl's
    pre-sharded updates (engine = trainer after a p2p sync with the load proof:
    ``tests/integration/weight_sync/test_engine_tp2_families.py``); ``--cpu-scale`` twins of recipes
    whose engines have TP > 1 then keep engine TP 2 (:data:`megarl.launch.cpu_scale.ENGINE_TP2_FAMILIES`)."""
    block_spec: str | None = None
    """Where Megatron-Core's GPT block spec cannot express the family: the import path
    (``package.module:function``) of the function that builds its decoder block spec,
    ``(config: TransformerConfig, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None)
    -> TransformerBlockSubmodules`` (``pp_rank`` None: this rank's, from Megatron's parallel state).
    :func:`megarl.training.model.decoder_block_spec` calls it, then puts in the local spec's attention
    modules as for every family. A path, not the function: those modules live in ``megarl.training``,
    which ``models/`` does not import. None: Megatron's ``get_gpt_decoder_block_spec`` (RMSNorm)."""
    local_spec_only: str | None = None
    """Why the family has no Transformer Engine layer spec megarl can build (the model type's
    ``spec='te'`` error; ``spec='auto'`` then takes the local spec on CUDA too); None: it has one."""
    weight_sync_refusal: str | None = None
    """What weight sync does not plan yet for this family and why (completes "weight sync is not
    planned yet for ..."): :func:`megarl.weight_sync.model_specs.param_specs_from_hf_config` raises it
    as a ``SpecError``, which ``megarl plan`` / ``validate`` report; None: weight sync is planned."""
    qk_norm_over_heads: bool = False
    """True where the q/k RMSNorms normalise all heads of a token together (MiniMax-M2's ``q_norm
    [heads * head_dim]``) instead of each head: the engine splits their weights by heads over its TP
    ranks (SGLang's ``MiniMaxM2RMSNormTP``), which weight sync follows
    (:func:`megarl.weight_sync.model_specs.engine_split_for`); the trainer's norm comes from
    :attr:`block_spec`."""
    tiny_config: Callable[[Any, dict], tuple[Any, type]] | None = None
    """``(TinyModelSpec, common HF config kwargs) -> (HF config, transformers model class)``: the
    family's ``tiny:`` model (:mod:`megarl.models.tiny`), shaped like its released models, scaled
    down. None: no ``tiny:`` model (and no ``--cpu-scale`` twin)."""
    tiny_random_norms: bool = False
    """The tiny builder replaces HF's constant initial RMSNorm weights and router biases by seeded
    random ones, so a conversion that swaps two same-shaped norms changes the logits."""
    tiny_mtp_layer: bool = False
    """The tiny builder can append a multi-token-prediction layer as the family's releases carry one
    (``TinyModelSpec.mtp_layers``, :func:`megarl.models.tiny.append_mtp_layer`)."""

    def text(self, hf_config):
        """The language model's config of an HF config (object or ``config.json`` dict): the nested
        one (:attr:`text_config`) or the config itself. Sizes (``vocab_size``, ``num_hidden_layers``,
        ``hidden_size``) are read from it."""
        return hf_config if self.text_config is None else self.text_config(hf_config)

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
            tie_word_embeddings=arch["tie_word_embeddings"], linear_key_dim=arch.get("linear_key_dim", 0),
            linear_value_dim=arch.get("linear_value_dim", 0), linear_value_heads=arch.get("linear_num_value_heads", 0),
            index_head_dim=arch.get("index_head_dim", 0), index_rope_dim=arch.get("index_rope_dim", 0))


def discover_families(package: str) -> tuple[Family, ...]:
    """The families of a package of family modules: every module of ``package`` whose name does not
    start with ``_`` (a shared helper's does), imported in name order, and its ``FAMILY``.

    Raises:
        ValueError: a module that defines no ``FAMILY`` :class:`Family` (names the module); two
            families claiming one name or HF ``model_type`` (names both).
    """
    path = importlib.import_module(package).__path__
    families: list[Family] = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise ValueError(f"{module.__name__}: a family module must define FAMILY = Family(...) (found "
                             f"{type(family).__name__}); a helper module's name starts with '_'")
        families.append(family)
    owners: dict[str, str] = {}
    for family in families:
        for key in dict.fromkeys((family.name, *family.model_types)):
            if owners.setdefault(key, family.name) != family.name:
                raise ValueError(f"{package}: families {owners[key]!r} and {family.name!r} both claim {key!r}")
    return tuple(families)


@functools.cache
def all_families() -> tuple[Family, ...]:
    """Every family of this package (:func:`discover_families`), in module-name order."""
    return discover_families(__name__)


@functools.cache
def _registry() -> dict[str, Family]:
    """Family name and each HF ``model_type`` -> its family."""
    return {key: family for family in all_families() for key in (family.name, *family.model_types)}


def find_family(name_or_config) -> Family | None:
    """:func:`get_family`, or None for a name or config no family handles."""
    return _registry().get(getattr(name_or_config, "model_type", name_or_config))


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


def text_config_of(hf_config):
    """The language model's config of an HF config (object or ``config.json`` dict): its family's
    :meth:`Family.text`, or the config itself when no family handles it. What a module that reads
    sizes from a config (``vocab_size``, ``num_hidden_layers``, ...) reads them from."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)
    family = None if model_type is None else _registry().get(model_type)
    return hf_config if family is None else family.text(hf_config)


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
