"""One canonical naming for the local and Transformer Engine layer specs.

The Transformer Engine spec's parameter names are derived here without Transformer Engine: the
spec tree comes from Megatron-Core's own layer specs
(``get_gpt_decoder_layer_specs``, the whole model's layers; the TE wrapper classes, mocks
without TE, are compared by identity) and each leaf
module's parameters from the names TE 2.x registers (checked against TE's source:
``LayerNormLinear``: ``layer_norm_weight``, ``weight``, ``bias`` if biased; ``Linear``: ``weight``,
``bias``; ``GroupedLinear``: ``weight{i}``; ``RMSNorm``: ``weight``). The same walk over the local
spec must give exactly the local model's names (``Family.megatron_shapes``, itself checked against
real Megatron builds), which validates the walk.
"""
import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.models.families import get_family
from megarl.models.mapping import canonical_name, global_name, lookup
from megarl.models.naming import TE_TO_CANONICAL
from megarl.models.tiny import TinyModelSpec, _hf_config


class _GroupedColumn:
    """Stands for ``TEColumnParallelGroupedLinear`` (None in Megatron without TE) in the spec tree."""


class _GroupedRow:
    """Stands for ``TERowParallelGroupedLinear``."""


def _hf(family: str):
    return _hf_config(TinyModelSpec(family=family), 2048, 0, 1)[0]


@pytest.fixture
def te_spec(monkeypatch):
    """``get_gpt_decoder_block_spec`` for the TE spec as Megatron-Core 0.16.1 writes it."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(provider, "TEColumnParallelGroupedLinear", _GroupedColumn)
    monkeypatch.setattr(provider, "TERowParallelGroupedLinear", _GroupedRow)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te_ext.TENorm, raising=False)
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid

    monkeypatch.setattr(hybrid, "TESpecProvider", provider.TESpecProvider, raising=False)  # Qwen3.5's hybrid
    return te_ext


def _leaf_params(te_ext) -> dict:
    """Parameter names a leaf module registers: ``(weights, has_bias)`` per class."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {te_ext.TELayerNormColumnParallelLinear: ["layer_norm_weight", "weight"],
            te_ext.TEColumnParallelLinear: ["weight"], te_ext.TERowParallelLinear: ["weight"],
            te_ext.TELinear: ["weight"], ColumnParallelLinear: ["weight"], RowParallelLinear: ["weight"]}


def _walk(spec, cfg, prefix: str, leaves: dict, *, bias: bool = False) -> list[str]:
    """Parameter names of the module ``spec`` builds, following Megatron-Core 0.16.1's constructors."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    subs = spec.submodules if isinstance(spec, ModuleSpec) else None

    def sub(field, name=None, **kw):
        return _walk(getattr(subs, field), cfg, f"{prefix}{name or field}.", leaves, **kw)

    experts = cfg.num_moe_experts or 0
    if module in leaves:
        return [prefix + n for n in leaves[module]] + ([prefix + "bias"] if bias else [])
    if module is IdentityOp or module is None:
        return []
    if module in (_GroupedColumn, _GroupedRow):
        return [f"{prefix}weight{i}" for i in range(experts)]
    if "Norm" in getattr(module, "__name__", ""):  # TENorm, WrappedTorchNorm: RMSNorm weight
        return [prefix + "weight"]
    if module is TransformerLayer:
        return sub("input_layernorm") + sub("self_attention") + sub("pre_mlp_layernorm") + sub("mlp")
    if module.__name__.endswith("GatedDeltaNet"):  # Megatron's (TE spec) and megarl's local one
        return (sub("in_proj") + [prefix + n for n in ("conv1d.weight", "dt_bias", "A_log")] + sub("out_norm")
                + sub("out_proj"))
    if module is SelfAttention:
        return (sub("linear_qkv", bias=cfg.add_qkv_bias or cfg.add_bias_linear) + sub("q_layernorm")
                + sub("k_layernorm") + sub("linear_proj"))
    if module is MLASelfAttention:
        q = (sub("linear_q_proj") if cfg.q_lora_rank is None else
             sub("linear_q_down_proj") + sub("linear_q_up_proj") + sub("q_layernorm"))
        return q + sub("linear_kv_down_proj") + sub("linear_kv_up_proj") + sub("kv_layernorm") + sub("linear_proj")
    if module in (MLP, SharedExpertMLP, TEGroupedMLP):
        gate = [prefix + "gate_weight"] if module is SharedExpertMLP and cfg.moe_shared_expert_gate else []
        return sub("linear_fc1") + sub("linear_fc2") + gate
    if module is MoELayer:
        router = [prefix + "router.weight"] + ([prefix + "router.expert_bias"]
                                               if cfg.moe_router_enable_expert_bias else [])
        shared = sub("shared_experts") if cfg.moe_shared_expert_intermediate_size else []
        return router + sub("experts") + shared
    if module is SequentialMLP:
        return [n for i in range(experts) for n in
                _walk(ModuleSpec(module=MLP, submodules=subs), cfg, f"{prefix}local_experts.{i}.", leaves)]
    raise AssertionError(f"{prefix}: module {module} not covered by the walk")


def _model_names(hf_config, te: bool, te_ext, grouped) -> list[str]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    from megarl.training.model import FUSIONS, build_transformer_config

    # The TE fusions' kernels are checked when the config is built; only the spec tree is needed here.
    model_cfg = ModelConfig(moe_grouped_gemm=grouped, megatron_overrides={name: False for name in FUSIONS})
    cfg = build_transformer_config(hf_config, ParallelConfig(), model_cfg, device="meta", use_te=te)
    layers = get_gpt_decoder_layer_specs(cfg, use_transformer_engine=te, normalization="RMSNorm")
    if cfg.experimental_attention_variant == "gated_delta_net":  # the hybrid spec megarl builds (training.model)
        from megarl.training.local_gdn import GainRMSNorm, local_hybrid_block_spec, te_hybrid_block_spec

        layers = (te_hybrid_block_spec if te else local_hybrid_block_spec)(cfg, None, pp_rank=0).layer_specs
        mixers = [spec.submodules.self_attention for spec in layers]  # the DeltaNet's gated norm is w * x
        out_norms = [m.submodules.out_norm for m in mixers if hasattr(m.submodules, "out_norm")]
        assert out_norms and set(out_norms) == {GainRMSNorm}
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i, layer in enumerate(layers):
        names += _walk(layer, cfg, f"decoder.layers.{i}.", _leaf_params(te_ext))
    return names


CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3", None), ("deepseek_v3", True), ("glm4_moe", True),
         ("kimi_k25", True), ("qwen3_5_moe", False)]


@pytest.mark.parametrize("family,grouped", CASES)
def test_te_spec_names_map_onto_the_weight_sync_plan(te_spec, family, grouped):
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.manifest_checks import check_local_params
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    hf_config = _hf(family)
    fam = get_family(hf_config)
    expected = set(fam.megatron_shapes(fam.architecture(hf_config)))
    local = _model_names(hf_config, False, te_spec, grouped=False if grouped is not None else None)
    assert sorted(local) == sorted(expected)  # the walk reproduces the local model's names

    te = _model_names(hf_config, True, te_spec, grouped)
    assert any(n.endswith(("linear_qkv.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight",
                           "in_proj.layer_norm_weight")) for n in te)
    if grouped:
        assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in te)
    num_experts = fam.layout(hf_config).num_experts
    trainer_names = [global_name(n, layer_number=int(n.split(".")[2]) + 1 if n.startswith("decoder.layers.")
                                 else None, ep_rank=0, num_local_experts=max(num_experts, 1)) for n in te]
    for name in te:  # every TE name also resolves in the family's table (loading, export)
        lookup(fam.table, name)
    specs = param_specs_from_hf_config(hf_config)
    assert sorted(trainer_names) == sorted(s.name for s in specs)
    by_name = {s.name: s for s in specs}
    plan = build_plan(TrainerLayout(), EngineLayout(), specs)
    check_local_params(plan, 0, {n: torch.empty(by_name[n].shape, device="meta",
                                                         dtype=getattr(torch, by_name[n].dtype))
                                 for n in trainer_names})


def test_canonical_name_examples_and_identity():
    assert canonical_name("decoder.layers.3.mlp.experts.linear_fc1.weight5") == \
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc2.bias1") == \
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"
    assert canonical_name("decoder.layers.7.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.7.input_layernorm.weight"
    assert canonical_name("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    for canonical in TE_TO_CANONICAL.values():  # canonical names are fixed points
        name = canonical.format(L=2, E=3)
        assert canonical_name(name) == name
