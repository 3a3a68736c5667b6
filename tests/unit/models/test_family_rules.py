"""What each :class:`~megarl.models.families.Family` says about the rollout engine, checked against the
installed SGLang 0.5.23: its class exists and is registered, its ``lm_head`` rule is what the class's
``__init__`` does, its parser names are SGLang's, and the ``tiny:`` model's architecture is that class."""
import ast
import importlib.util
from pathlib import Path

import pytest

from megarl.models.families import all_families
from megarl.models.tiny import TinyModelSpec

FAMILIES = {f.name: f for f in all_families()}


def _engine_source(engine_class: str) -> tuple[dict[str, ast.ClassDef], list[str]]:
    """The classes of the SGLang module holding ``engine_class`` (parsed, not imported: on CPU the
    model modules import CUDA / vision packages this machine lacks) and its ``EntryClass``."""
    top, *parts = engine_class.split(".")[:-1]
    path = Path(importlib.util.find_spec(top).origin).parent.joinpath(*parts).with_suffix(".py")
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    entry = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "EntryClass" for t in node.targets))
    names = [e.id for e in entry.elts] if isinstance(entry, ast.List) else [entry.id]
    return classes, names


def _init_of(classes: dict[str, ast.ClassDef], name: str, builds: str = "") -> ast.FunctionDef:
    """``__init__`` of class ``name``, or of the first base (same module) that defines one; with
    ``builds``, an ``__init__`` that only calls ``super().__init__`` without that text (SGLang's
    ``Qwen3_5MoeForCausalLM``) is passed over for its base's."""
    node = classes[name]
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is not None:
        source = ast.unparse(init)
        if not builds or builds in source or "super().__init__(" not in source:
            return init
    return _init_of(classes, next(b.id for b in node.bases if getattr(b, "id", None) in classes), builds)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_engine_class_is_registered_and_its_lm_head_rule_holds(name):
    family = FAMILIES[name]
    classes, entries = _engine_source(family.engine_class)
    class_name = family.engine_class.rpartition(".")[2]
    assert class_name in entries  # what SGLang's ModelRegistry resolves from config.architectures
    if family.engine_text_class:  # a wrapper (Kimi-K2.5): it builds that class, which builds the lm_head
        text_class = family.engine_text_class.rpartition(".")[2]
        assert f"self.language_model = {text_class}(" in ast.unparse(_init_of(classes, class_name))
        classes, entries = _engine_source(family.engine_text_class)
        class_name = text_class
        assert class_name in entries
    source = ast.unparse(_init_of(classes, class_name, "self.lm_head"))  # DeepseekV3ForCausalLM: DeepseekV2's
    assert "self.lm_head = ParallelLMHead(" in source
    # The class keeps lm_head apart for a tied checkpoint exactly when it never reads the field
    # (Qwen3 / DeepSeek-V2: `if ... config.tie_word_embeddings: self.lm_head = self.model.embed_tokens`).
    assert family.engine_unties_lm_head == ("tie_word_embeddings" not in source)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parsers_are_sglang_names(name):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    family = FAMILIES[name]
    for reasoning, tools in [(family.reasoning_parser, family.tool_call_parser)] + [
            (v.reasoning_parser, v.tool_call_parser) for v in family.parser_variants]:
        assert reasoning is None or reasoning in ReasoningParser.DetectorMap
        assert tools in FunctionCallParser.ToolCallParserEnum


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.tiny_config))
def test_tiny_model_is_served_by_the_engine_class(name):
    family = FAMILIES[name]
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1e6)
    cfg, model_cls = family.tiny_config(TinyModelSpec(family=name), common)
    assert cfg.model_type in family.model_types
    assert model_cls.__name__ == family.engine_class.rpartition(".")[2]
