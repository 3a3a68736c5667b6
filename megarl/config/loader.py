"""Load a run configuration: YAML files (which may extend others) + ``key.sub=value`` overrides.

The result is an OmegaConf structured config typed by :class:`megarl.config.schema.MegarlConfig`.
Every unknown key and every wrong type is collected (not only the first), each error naming the key,
the value, the file and line it came from (or the override), and what would be valid; then one
:class:`ConfigError` lists them all.

Composition: a YAML file may say ``extends: base.yaml`` (or a list); paths are relative to the file.
Later files and then the command-line overrides win; overrides follow Hydra's grammar (``key=value``,
``+key=value``, ``++key=value``, ``~key``, ``~key=value``: :func:`load_config`). Keys whose schema
type is a free-form dict (``rollout.tools``, ``rollout.reward_kwargs``) are taken whole.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.schema import MegarlConfig
from megarl.errors import UserError


class _NoValue:
    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE = _NoValue()
"""The value of an issue about a key that has none to show (``~key`` of a key that does not exist)."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration: the dotted key, its value, where it came from, and why."""

    key: str
    message: str
    value: Any = None
    source: str = ""

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        value = "" if self.value is NO_VALUE else f"={self.value!r}"
        return f"{self.key}{value}{where}: {self.message}"


class ConfigError(UserError):
    """A configuration is invalid. ``issues`` lists every problem found, not only the first."""

    def __init__(self, issues: Iterable[ConfigIssue]):
        self.issues = list(issues)
        lines = "\n".join(f"  - {i}" for i in self.issues)
        super().__init__(f"invalid configuration ({len(self.issues)} problem"
                         f"{'s' if len(self.issues) != 1 else ''}):\n{lines}")


def _now(fmt: str = "%Y%m%d-%H%M%S") -> str:
    return datetime.datetime.now().strftime(fmt)


if not OmegaConf.has_resolver("now"):
    # omegaconf 2.4 renamed register_new_resolver to register_resolver.
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("now", _now, use_cache=True)


def _key_lines(text: str) -> dict[str, int]:
    """Map each dotted key of a YAML mapping document to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                lines[key] = k.start_mark.line + 1
                walk(v, key)

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> list[tuple[dict, str, dict[str, int]]]:
    """Read ``path`` and the files it extends, base first: a list of (data, file, key lines)."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in chain + (path,))
        raise ConfigError([ConfigIssue("extends", f"cyclic extends: {cycle}", source=str(path))])
    if not path.is_file():
        raise ConfigError([ConfigIssue("config", "file not found", value=str(path))])
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError([ConfigIssue(e.key, f"duplicate key (first at line {e.first_line}; YAML would keep the "
                                       f"last silently)", NO_VALUE, f"{path}:{e.line}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError([ConfigIssue("config", f"not valid YAML: {e}", value=str(path))]) from e
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("config", "top level must be a mapping", value=str(path))])
    parents = data.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    lines = _key_lines(text)
    layers: list[tuple[dict, str, dict[str, int]]] = []
    for parent in parents:
        if not (path.parent / parent).is_file():  # named with the file (and line) that asked for it
            raise ConfigError([ConfigIssue("extends", f"file not found: {path.parent / parent}", parent,
                                           f"{path}:{lines.get('extends', 1)}")])
        layers += _read_yaml(path.parent / parent, chain + (path,))
    layers.append((data, str(path), lines))
    return layers


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, first_line: int, line: int):
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise _DuplicateKey(key, seen[key], line)
            if isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep)


def _is_free_dict(node: DictConfig, key: str) -> bool:
    """True when ``key`` of a structured node is typed as a free-form Dict (taken whole)."""
    obj_type = OmegaConf.get_type(node)
    if obj_type is None or not dataclasses.is_dataclass(obj_type):
        return True
    fields = {f.name: f for f in dataclasses.fields(obj_type)}
    if key not in fields:
        return False
    return str(fields[key].type).startswith(("Dict", "dict"))


def _apply(cfg: DictConfig, data: dict, source: str, lines: dict[str, int],
           issues: list[ConfigIssue], prefix: str = "", sources: dict[str, str] | None = None,
           origin: str = "") -> None:
    """Set every leaf of ``data`` on ``cfg``, collecting unknown-key and type errors; ``sources``
    (when given) maps each dotted key set to where (``file:line``, or ``origin`` when given)."""
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        where = f"{source}:{lines[dotted]}" if dotted in lines else source
        node = OmegaConf.select(cfg, prefix) if prefix else cfg
        if not isinstance(node, DictConfig) or key not in node.keys():
            valid = sorted(node.keys(), key=str) if isinstance(node, DictConfig) else []
            issues.append(ConfigIssue(dotted, f"unknown key; valid keys here: {', '.join(map(str, valid))}",
                                      value, where))
            continue
        child = node[key] if not OmegaConf.is_missing(node, key) else None
        if isinstance(value, dict) and isinstance(child, DictConfig) and not _is_free_dict(node, key):
            _apply(cfg, value, source, lines, issues, dotted, sources, origin)
            continue
        try:
            # Free-form dicts (rollout.tools) merge across files, like OmegaConf.merge.
            OmegaConf.update(cfg, dotted, value, merge=isinstance(value, dict))
        except OmegaConfBaseException as e:
            msg = str(e).split("\n")[0]
            issues.append(ConfigIssue(dotted, f"wrong type: {msg}", value, where))
            continue
        if sources is not None:
            sources[dotted] = origin or where


@dataclass(frozen=True)
class Override:
    """One command-line override in Hydra's grammar.

    ``op``: ``set`` (``key=value``), ``add`` (``+key=value``: the key must not exist), ``force``
    (``++key=value``: add or override) or ``delete`` (``~key``, or ``~key=value``: only if it holds
    that value). ``value`` is read as YAML; ``has_value`` is False for a bare ``~key``.
    """

    op: str
    key: str
    value: Any = None
    has_value: bool = True
    text: str = ""


_PREFIXES = (("++", "force"), ("+", "add"), ("~", "delete"))


def parse_override(text: str) -> Override:
    """Parse one override: ``key.sub=value``, ``+key=value``, ``++key=value``, ``~key`` or ``~key=value``.

    The value is read as YAML (``4``, ``true``, ``[a, b]``, ``{timeout_s: 5}``).

    Args:
        text: the override as typed on the command line.

    Returns:
        The parsed :class:`Override`.

    Raises:
        ConfigError: an empty key, or no ``=`` where the form needs a value; the issue names ``text``.
    """
    op, rest = "set", text
    for prefix, name in _PREFIXES:
        if text.startswith(prefix):
            op, rest = name, text[len(prefix):]
            break
    key, sep, raw = rest.partition("=")
    if not key.strip() or (not sep and op != "delete"):
        raise ConfigError([ConfigIssue(text, "override must look like key.sub=value, +key=value, ++key=value, "
                                       "~key or ~key=value (Hydra's grammar)", source="command line")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return Override(op, key.strip(), value if sep else None, bool(sep), text)


def _nest(dotted: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _lookup(cfg: DictConfig, dotted: str) -> tuple[DictConfig | None, str]:
    """The node holding ``dotted``'s last part and that part, or (None, part) when a parent is absent."""
    *parents, name = dotted.split(".")
    node: Any = cfg
    for part in parents:
        if not isinstance(node, DictConfig) or part not in node.keys() or OmegaConf.is_missing(node, part):
            return None, name
        node = node[part]
    return (node if isinstance(node, DictConfig) else None), name


def _schema_default(node: DictConfig, name: str) -> Any:
    """The schema default of field ``name`` of a structured node (a section: its default node)."""
    fresh = OmegaConf.structured(OmegaConf.get_type(node))
    return "???" if OmegaConf.is_missing(fresh, name) else fresh[name]


def _delete(cfg: DictConfig, ov: Override, issue: Callable[[str], None]) -> None:
    """``~key``: a schema field goes back to its schema default; a key of a free dict is deleted."""
    node, name = _lookup(cfg, ov.key)
    if node is None or name not in node.keys():
        issue("cannot remove: the key does not exist")
        return
    if ov.has_value:
        current = node[name] if not OmegaConf.is_missing(node, name) else "???"
        if isinstance(current, DictConfig):
            current = OmegaConf.to_container(current, resolve=True)
        if current != ov.value:
            issue(f"not removed: its value is {current!r}, not {ov.value!r}")
            return
    obj_type = OmegaConf.get_type(node)
    if obj_type is not None and dataclasses.is_dataclass(obj_type):
        node[name] = _schema_default(node, name)
    else:
        del node[name]


def _apply_override(cfg: DictConfig, ov: Override, issues: list[ConfigIssue], sources: dict[str, str]) -> None:
    """Apply one parsed override to ``cfg``, collecting its problems (each naming the override)."""
    def issue(message: str) -> None:
        value = ov.value if ov.has_value else NO_VALUE
        issues.append(ConfigIssue(ov.key, message, value, f"command line: {ov.text}"))

    if ov.op == "delete":
        _delete(cfg, ov, issue)
        sources.update({k: f"default (command line: {ov.text})" for k in list(sources)
                        if k == ov.key or k.startswith(ov.key + ".")})
        return
    if ov.op == "add":
        node, name = _lookup(cfg, ov.key)
        if node is not None and name in node.keys():
            issue("cannot add: the key already exists (+key adds a new key; use key=value or ++key=value)")
            return
    _apply(cfg, _nest(ov.key, ov.value), "command line", {}, issues, sources=sources,
           origin=f"command line: {ov.text}")


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose the schema defaults, the YAML file chain and the overrides into a typed config.

    Args:
        path: a YAML file (may ``extends`` others), or None for schema defaults only.
        overrides: applied last, in order, in Hydra's grammar (:func:`parse_override`):
            ``key.sub=value`` sets (a key a free dict lacks is added; elsewhere an unknown key is an
            error); ``+key=value`` adds a key that does not exist (error if it does: every schema
            field exists); ``++key=value`` adds or overrides; ``~key`` removes a key, ``~key=value``
            only if it holds that value. Removing a schema field (or section) resets it to its
            schema default; removing a key of a free dict (``rollout.tools.python``) deletes it.

    Returns:
        A structured ``DictConfig`` of :class:`MegarlConfig` (struct mode: unknown keys raise).

    Raises:
        ConfigError: unknown keys, wrong types, unreadable or cyclic files — all of them at once.
    """
    cfg, issues, _ = compose_config(path, overrides)
    if issues:
        raise ConfigError(issues)
    return cfg


def compose_config(path: str | os.PathLike | None, overrides: Iterable[str] = ()
                   ) -> tuple[DictConfig, list[ConfigIssue], dict[str, str]]:
    """:func:`load_config` without raising on unknown keys and wrong types: the config with every
    other value applied, those problems, and where each key set got its value (``file:line`` or
    ``command line: OVERRIDE``; a key absent holds its schema default). ``megarl validate`` reports
    the problems together with the rules' (:func:`megarl.launch.preflight.prepare_config`).

    Raises:
        ConfigError: a file missing, unreadable, not YAML, with a duplicate key, or extending in a
            cycle; a malformed override (nothing else can be composed without them).
    """
    cfg = OmegaConf.structured(MegarlConfig)
    issues: list[ConfigIssue] = []
    sources: dict[str, str] = {}
    layers = _read_yaml(Path(path), ()) if path is not None else []
    for data, source, lines in layers:
        _apply(cfg, data, source, lines, issues, sources=sources)
    for text in overrides:
        _apply_override(cfg, parse_override(text), issues, sources)
    return cfg, issues, sources


def load_config_sources(path: str | os.PathLike | None, overrides: Iterable[str] = ()
                        ) -> tuple[DictConfig, dict[str, str]]:
    """:func:`load_config` and where each value came from (:func:`compose_config`).

    Raises:
        ConfigError: as :func:`load_config`.
    """
    cfg, issues, sources = compose_config(path, overrides)
    if issues:
        raise ConfigError(issues)
    return cfg, sources


def to_yaml_with_sources(cfg: DictConfig, sources: dict[str, str]) -> str:
    """:func:`to_yaml`, each key's line ending with ``# <where it was set>`` (its own entry in
    ``sources``, else its nearest parent's, else ``default``)."""
    text = to_yaml(cfg)
    by_line = {line: key for key, line in _key_lines(text).items()}
    lines = text.splitlines()
    out = []
    for number, line in enumerate(lines, start=1):
        key = by_line.get(number)
        if key is None or line.endswith(":"):  # not a key, or a section's key
            out.append(line)
            continue
        parts = key.split(".")
        origin = next((sources[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                       if ".".join(parts[:n]) in sources), "default")
        indent = len(line) - len(line.lstrip())
        if number == len(lines) or number + 1 in by_line or lines[number].startswith(" " * indent + "- "):
            out.append(f"{line}  # {origin}")  # the value ends on this line
        else:  # a value continued on the next lines: the comment above it
            out.append(f"{' ' * indent}# {origin}\n{line}")
    return "\n".join(out) + "\n"


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (interpolations resolved), as saved beside each run."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def save_resolved(cfg: DictConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``run_dir/config.yaml`` with the resolved config; returns its path."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    tmp.replace(out)
    return out
