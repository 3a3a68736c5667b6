"""Declared domains (issue 29 part 4): every enum, number and string field of the schema, and every
setting of the built-in tools and rewards, has a domain in megarl.config.domains, and megarl validate
refuses a value outside it, naming the key, the value and the domain."""
import dataclasses
import inspect
import types
import typing
from pathlib import Path

import pytest
from config_issues import validate_issues

from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.config.domains import DOMAINS, REWARD_DOMAINS, TOOL_DOMAINS, Choice, Range, Registered, Text
from megarl.config.schema import MegarlConfig

REPO = Path(__file__).resolve().parents[3]
SCALARS = (int, float, str)


def _scalar(hint) -> type | None:
    """int, float or str when ``hint`` is one (or Optional of one), else None (bool, lists, dicts)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if hint in SCALARS else None


def _schema_scalars(cls=MegarlConfig, prefix: str = "") -> dict[str, type]:
    """Every scalar field of the schema, nested sections included, by dotted key."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_schema_scalars(hints[f.name], f"{prefix}{f.name}."))
        elif _scalar(hints[f.name]):
            out[prefix + f.name] = _scalar(hints[f.name])
    return out


def _constructor_scalars(factory) -> dict[str, type]:
    """The scalar keyword parameters of a tool or reward class's constructor."""
    init = factory.__init__ if inspect.isclass(factory) else factory
    hints = typing.get_type_hints(init)
    return {name: _scalar(hints[name]) for name in inspect.signature(init).parameters
            if name != "self" and _scalar(hints.get(name))}


def _undeclared(fields: dict[str, type], domains: dict) -> list[str]:
    """Fields without a domain, and number fields declared as free text."""
    missing = [key for key in fields if key not in domains]
    numbers_as_text = [key for key, kind in fields.items()
                       if kind in (int, float) and isinstance(domains.get(key), Text)]
    return missing + numbers_as_text


def test_every_schema_field_has_a_declared_domain():
    fields = _schema_scalars()
    assert {"logging.level", "rollout.agent.tool_timeout_s", "cluster.master_port",
            "weight_sync.bucket_size_mb", "rollout.engine.grammar_backend"} <= set(fields)
    undeclared = _undeclared(fields, DOMAINS)
    assert not undeclared, f"declare a domain in megarl/config/domains.py: {undeclared}"
    assert not set(DOMAINS) - set(fields), f"domains of no schema field: {set(DOMAINS) - set(fields)}"


def test_every_builtin_tool_and_reward_setting_has_a_declared_domain():
    from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY
    from megarl.rollout.tools import TOOL_REGISTRY

    for registry, domains in ((TOOL_REGISTRY, TOOL_DOMAINS), (REWARD_REGISTRY, REWARD_DOMAINS)):
        builtins = {name: f for name, f in registry.items() if f.__module__.startswith("megarl.")}
        assert set(builtins) == set(domains), (set(builtins), set(domains))
        for name, factory in builtins.items():
            params = _constructor_scalars(factory)
            assert not _undeclared(params, domains[name]), (name, _undeclared(params, domains[name]))
            assert not set(domains[name]) - set(params), (name, set(domains[name]) - set(params))
    assert {"timeout_s", "memory_mb", "max_processes"} <= set(TOOL_DOMAINS["python"])


def test_shipped_defaults_are_inside_their_domains():
    from megarl.config.domains import domain_issues

    assert domain_issues(load_config(None, ["model.hf_path=x", "data.train_path=y"])) == []


def _outside(domain, kind):
    """A value just outside a domain (None where every value of the type is inside)."""
    if isinstance(domain, (Choice, Registered)):  # a registered name is a choice too
        return "not_a_choice"
    if not isinstance(domain, Range) or (domain.low is None and domain.high is None):
        return None
    if domain.low is not None:
        step = 0 if domain.bounds[0] == "(" else (1 if kind is int else 1e-3)
        value = domain.low - step
        if value in domain.also:  # top_k: -1 is allowed, 0 is not
            value = domain.low - 1 + 1e-9 if kind is float else 0
        return int(value) if kind is int else value
    step = 0 if domain.bounds[1] == ")" else (1 if kind is int else 1e-3)
    return int(domain.high + step) if kind is int else domain.high + step


_issues = validate_issues


@pytest.mark.parametrize("kinds", [(int, float), (str,)], ids=["numbers", "enums"])
def test_every_domain_is_enforced_naming_key_value_and_domain(good_overrides, kinds):
    """Table-driven: a value just outside each field's domain is refused by validate, and the
    message names the field, the value and the domain."""
    fields = _schema_scalars()
    outside = {key: _outside(DOMAINS[key], kind) for key, kind in fields.items() if kind in kinds}
    outside = {key: value for key, value in outside.items() if value is not None}
    assert len(outside) > (40 if kinds == (int, float) else 20)
    issues = _issues(good_overrides + [f"{key}={value}" for key, value in outside.items()])
    missing = sorted(key for key in outside if key not in issues)
    assert not missing, missing
    for key, value in outside.items():
        assert f"{key}={value!r}" in issues[key] and str(DOMAINS[key]) in issues[key], issues[key]


def test_issue_examples_refused_by_megarl_validate(good_overrides, capsys, monkeypatch, tmp_path):
    """`logging.level=LOUD` and a negative `rollout.tools.python.timeout_s` (issue 29), through the CLI."""
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    bad = ["logging.level=LOUD", "rollout.tools={python: {timeout_s: -5, memory_mb: 0}}",
           "rollout.reward_kwargs={executor: threads}"]
    assert cli_main(["validate", str(REPO / "configs" / "base.yaml"), *good_overrides, *bad]) == 2
    err = capsys.readouterr().err
    assert "logging.level='LOUD'" in err and "'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'" in err
    assert "rollout.tools.python.timeout_s=-5: must be in (0, inf)" in err
    assert "rollout.tools.python.memory_mb=0: must be in [1, inf)" in err
    assert "rollout.reward_kwargs.executor='threads': must be one of 'process', 'inline'" in err
    ok = ["logging.level=DEBUG", "rollout.tools={python: {timeout_s: 5}}"]
    assert cli_main(["validate", str(REPO / "configs" / "base.yaml"), *good_overrides, *ok]) == 0


def test_domain_strings():
    assert str(Range(0, None, "()")) == "in (0, inf)"
    assert str(Range(1, also=(-1,))) == "in [1, inf) or -1"
    assert Range(1, also=(-1,)).allows(-1) and not Range(1, also=(-1,)).allows(0)
    assert not Range(0).allows(True) and not Range(0).allows(float("nan"))
    assert str(Choice(("a", None))) == "one of 'a', None"
