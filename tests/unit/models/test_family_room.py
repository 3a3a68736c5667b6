"""A model family is one room (STYLE.md rule 12, issue 37 part 1): adding one is a module in
``megarl/models/families/`` plus its tests and fixtures.

What is checked, against behaviour where it can be and by reading the sources where only that can
say it: a family module registers by existing (discovery over a package written here, with a
module lacking ``FAMILY`` and two families claiming one ``model_type``); the trainer builds every
family's layer spec through the family (a family defined in this test, whose block spec is a file
written here, gets its own spec; the in-tree variants get theirs); a transform one family declares
is applied by the mapping without the mapping naming it; weight sync refuses a family by the family's
own field; and no module outside ``megarl/models/families/`` names a family or an attention variant
(the exceptions listed in ``ALLOWED``, each with the owner that removes it).
"""
from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from megarl.models import families as families_module
from megarl.models.families import Family, all_families, discover_families, get_family
from megarl.models.table import Entry, FamilyTransform, ModelLayout, TPSplit, Transform
from megarl.models.tiny import TinyModelSpec

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "megarl"
FAMILIES_DIR = PACKAGE / "models" / "families"


# ------------------------------------------------------------------ discovery

def _write_package(root: Path, name: str, modules: dict[str, str]) -> str:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, text in modules.items():
        (package / f"{module}.py").write_text(textwrap.dedent(text))
    return name


_FAMILY_MODULE = """
    import dataclasses
    from megarl.models.families import get_family
    FAMILY = dataclasses.replace(get_family("qwen3"), name={name!r}, model_types=({model_type!r},))
"""


def test_a_family_module_registers_by_existing(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _write_package(tmp_path, "room_pkg_ok", {
        "zeta": _FAMILY_MODULE.format(name="zeta", model_type="zeta_type"),
        "alpha": _FAMILY_MODULE.format(name="alpha", model_type="alpha_type"),
        "_shared": "HELPER = 1\n"})  # a helper module: no FAMILY, not a family
    assert [f.name for f in discover_families(package)] == ["alpha", "zeta"]  # name order


def test_a_module_without_a_family_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _write_package(tmp_path, "room_pkg_missing", {
        "alpha": _FAMILY_MODULE.format(name="alpha", model_type="alpha_type"), "helpers": "X = 1\n"})
    with pytest.raises(ValueError, match=r"room_pkg_missing\.helpers: a family module must define FAMILY"):
        discover_families(package)


def test_two_families_claiming_one_model_type_are_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _write_package(tmp_path, "room_pkg_clash", {
        "alpha": _FAMILY_MODULE.format(name="alpha", model_type="shared_type"),
        "beta": _FAMILY_MODULE.format(name="beta", model_type="shared_type")})
    with pytest.raises(ValueError, match="families 'alpha' and 'beta' both claim 'shared_type'"):
        discover_families(package)


def test_every_module_of_the_families_package_is_registered():
    modules = sorted(p.stem for p in FAMILIES_DIR.glob("*.py") if not p.name.startswith("_"))
    assert sorted(f.name for f in all_families()) == modules
    for family in all_families():
        assert get_family(family.name) is family
        assert all(get_family(model_type) is family for model_type in family.model_types)


# ------------------------------------------------------------------ layer specs through the family

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=512, rope_theta=1e6)


def _megatron_config(family: Family):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.model import build_transformer_config

    hf_config, _ = family.tiny_config(TinyModelSpec(family=family.name), dict(_COMMON))
    return build_transformer_config(hf_config, ParallelConfig(), ModelConfig())


def _attentions(block) -> list:
    return [spec.submodules.self_attention for spec in block.layer_specs]


def test_in_tree_variants_get_their_layer_spec_through_their_family():
    """Qwen3.5's DeltaNet layers, DeepSeek-V3.2's sparse attention and MiniMax-M2's full-head q/k
    norms come from each family's ``block_spec``; a family without one gets Megatron's spec with the
    local SDPA attention."""
    from megatron.core.transformer.attention import SelfAttention

    from megarl.training.full_head_qk_norm import FullHeadRMSNorm
    from megarl.training.local_attention import LocalSDPAttention
    from megarl.training.local_dsa import LocalDSAttention
    from megarl.training.local_gdn import LocalGatedDeltaNet
    from megarl.training.model import decoder_block_spec

    def block(name):
        family = get_family(name)
        return decoder_block_spec(family, _megatron_config(family), use_te=False, vp_stage=None, pp_rank=0)

    mixers = [a.module for a in _attentions(block("qwen3_5_moe"))]
    assert mixers == [LocalGatedDeltaNet] * 3 + [SelfAttention]
    assert all(a.submodules.core_attention.module is LocalDSAttention for a in _attentions(block("deepseek_v32")))
    for attention in _attentions(block("minimax_m2")):
        assert attention.submodules.q_layernorm.module is FullHeadRMSNorm
        assert attention.submodules.core_attention is LocalSDPAttention
    for attention in _attentions(block("qwen3_moe")):
        assert attention.module is SelfAttention and attention.submodules.core_attention is LocalSDPAttention


_HOOK = """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    CALLS = []

    def block_spec(config, *, use_te, vp_stage, pp_rank=None):
        CALLS.append((config.num_layers, use_te, vp_stage, pp_rank))
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                           vp_stage=vp_stage, pp_rank=pp_rank)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.q_layernorm = ModuleSpec(module=WrappedTorchNorm,
                                                                                params={"marked": True})
        return block
"""


def test_a_new_family_builds_its_own_layer_spec_without_editing_the_trainer(tmp_path):
    """A family the trainer has never heard of (its hook a file written here) gets the spec its hook
    returns, with the local spec's attention put in afterwards as for every family."""
    from megarl.plugins import load_object
    from megarl.training.local_attention import LocalSDPAttention
    from megarl.training.model import decoder_block_spec

    hook = tmp_path / "new_family_spec.py"
    hook.write_text(textwrap.dedent(_HOOK))
    family = dataclasses.replace(get_family("qwen3_moe"), name="new_family", block_spec=f"{hook}:block_spec")
    block = decoder_block_spec(family, _megatron_config(family), use_te=False, vp_stage=None, pp_rank=0)
    assert load_object(f"{hook}:block_spec", "test").__globals__["CALLS"] == [(4, False, None, 0)]
    for attention in _attentions(block):
        assert attention.submodules.q_layernorm.params == {"marked": True}
        assert attention.submodules.core_attention is LocalSDPAttention


def test_every_block_spec_and_local_only_reason_resolves():
    from megarl.plugins import load_object
    from megarl.training.model import _has_te_spec

    for family in all_families():
        if family.block_spec is not None:
            assert callable(load_object(family.block_spec, family.name)), family.name
        config = type("Config", (), {"model_type": family.model_types[0]})()
        if family.local_spec_only is None:
            assert _has_te_spec(family, config, "te")
        else:
            with pytest.raises(ValueError, match=re.escape(family.local_spec_only)):
                _has_te_spec(family, config, "te")
            assert not _has_te_spec(family, config, "auto")


# ------------------------------------------------------------------ a family's own transform

def test_a_family_transform_is_applied_by_the_mapping_that_does_not_name_it():
    from megarl.models.mapping import megatron_to_hf, to_hf, to_megatron

    flip = FamilyTransform("test_row_flip", lambda hf, layout: hf[0].flip(0), lambda full, layout: [full.flip(0)])
    entry = Entry(("model.norm.weight",), flip, TPSplit.NONE)
    layout = ModelLayout(family="new_family", num_layers=1, hidden_size=4, num_attention_heads=1, num_query_groups=1,
                         head_dim=4, vocab_size=8, padded_vocab_size=8)
    hf = torch.arange(4.0)
    assert to_megatron(entry, [hf], layout).tolist() == [3.0, 2.0, 1.0, 0.0]
    assert torch.equal(to_hf(entry, to_megatron(entry, [hf], layout), layout)[0], hf)
    table = {"decoder.final_layernorm.weight": entry}
    assert [(n, t.tolist()) for n, t in megatron_to_hf([("decoder.final_layernorm.weight", hf)], layout, table)] == [
        ("model.norm.weight", [3.0, 2.0, 1.0, 0.0])]


def test_family_transforms_have_names_of_their_own():
    owners: dict[str, set[str]] = {}
    for family in all_families():
        for entry in family.table.values():
            if isinstance(entry.transform, FamilyTransform):
                owners.setdefault(entry.transform.value, set()).add(family.name)
    assert owners, "no family declares a transform of its own (DeepSeek-V3.2's indexer rope rows should)"
    assert not set(owners) & {t.value for t in Transform}
    shared = {name: sorted(o) for name, o in owners.items() if len(o) > 1}
    assert all(set(o) <= {"deepseek_v32"} for o in shared.values()), shared


# ------------------------------------------------------------------ weight sync asks the family

def test_weight_sync_refuses_by_the_familys_own_reason(monkeypatch):
    from megarl.models.tiny import TinyModelSpec
    from megarl.weight_sync.model_specs import SpecError, param_specs_from_hf_config

    qwen3 = get_family("qwen3")
    hf_config, _ = qwen3.tiny_config(TinyModelSpec(family="qwen3"), dict(_COMMON))
    assert param_specs_from_hf_config(hf_config)  # planned as it is
    refused = dataclasses.replace(qwen3, weight_sync_refusal="the test's reason")
    monkeypatch.setattr(families_module, "get_family", lambda config: refused)
    with pytest.raises(SpecError, match=r"\(qwen3\): weight sync is not planned yet for the test's reason"):
        param_specs_from_hf_config(hf_config)


# ------------------------------------------------------------------ nobody else names a family

ALLOWED = {
    ("megarl/plan/shape.py", "qwen3_moe"): "qk_norm by model type: should read the family's architecture",
    ("megarl/plan/shape.py", "qwen3"): "as above",
    ("megarl/models/chat_templates/__init__.py", "qwen3"): "a template file's name (qwen3.jinja), not a family rule",
    ("megarl/models/chat_templates/__init__.py", "glm4_moe"): "a template file's name (glm4_moe.jinja)",
}
"""(file, family name) -> why it is still there. Only shrinks: an entry no longer needed fails the test."""

ATTENTION_VARIANTS = ("dsa", "gated_delta_net")
"""Megatron-Core 0.16.1's ``TransformerConfig.experimental_attention_variant`` values
(``transformer/transformer_config.py`` line 250)."""


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module's code: docstrings and other bare string statements (a
    field's docstring) are documentation and left out."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


def _named(words: set[str]) -> Counter:
    """(file, word) -> how many string constants outside the families' package (and the test helpers,
    ``megarl/testing``) name ``word`` (as a whole word, not inside a dotted module path)."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, words))) + r")(?![\w.])")
    found: Counter = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("megarl/models/families/", "megarl/testing/")):
            continue
        for text in _code_strings(path):
            found.update({(rel, word) for word in pattern.findall(text)})
    return found


def test_no_module_outside_the_families_names_a_family():
    words = {key for family in all_families() for key in (family.name, *family.model_types)}
    found = _named(words)
    assert sorted(set(found) - set(ALLOWED)) == [], "ask the Family (get_family / a Family field) instead"
    assert sorted(set(ALLOWED) - set(found)) == [], "no longer needed: remove from ALLOWED"


def test_no_module_outside_the_families_names_an_attention_variant():
    assert sorted(_named(set(ATTENTION_VARIANTS))) == [], "a family's layers come from its Family.block_spec"
