"""User code loaded by name from YAML: ``plugins:`` modules and ``pkg.mod:Name`` import paths.

A task is added without editing megarl. Its tools, reward, agent loop, dataset reader or RL loss
live in the user's own module, which either registers them (``@register_tool("search")``,
``@register_reward``, ``@register_agent``, ``@register_dataset``, ``@register_demonstrations``,
``@register_policy_loss``, ``@register_advantage_estimator``, ``@register_rollout_correction``) or is
named directly by import path (each registry is a :class:`megarl.registry.Registry`)::

    plugins: [my_pkg.tasks, examples/my_task/task.py]   # imported first, in every process
    algorithm:
      policy_loss: my_pkg.losses:my_loss                # slime's --custom-loss-function-path
      policy_loss_kwargs: {scale: 0.5}                  # its own hyperparameters
    rollout:
      tools: {search: {top_k: 3}}                       # a name my_pkg.tasks registered
      reward: my_pkg.tasks:exact_match                  # or an import path
    data:
      dataset: examples/my_task/task.py:load_rows       # a file path works as a module
    sft:
      demonstrations: my_pkg.tasks:demonstrations       # the SFT cold start's builder

A plugin is a dotted module name (importable from ``sys.path`` / ``PYTHONPATH``) or the path of a
``.py`` file (relative to the working directory; :func:`absolute_specs` makes it absolute so Ray
workers on other nodes find the same file on a shared filesystem). The driver imports the plugins
before validating, and every Ray actor that builds user objects imports them when it starts
(:func:`import_plugins` is idempotent). ``megarl validate`` resolves every name, so a misspelled
module, attribute or registry name is reported with the YAML key that names it.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any


class PluginError(ValueError):
    """A plugin or import path cannot be loaded; ``key`` is the YAML key that names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def is_file_module(module: str) -> bool:
    """``module`` names a ``.py`` file rather than a dotted module."""
    return module.endswith(".py") or "/" in module or "\\" in module


def _load_file(path: str, key: str) -> ModuleType:
    """Import a ``.py`` file once per absolute path (a stable module name derived from it)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise PluginError(key, f"plugin file not found: {file}")
    digest = hashlib.blake2b(str(file).encode(), digest_size=6).hexdigest()
    name = f"megarl_plugin_{file.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PluginError(key, f"cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing: the file's own dataclasses/pickling need it
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        raise PluginError(key, f"importing {file} failed: {type(e).__name__}: {e}") from e
    return module


def import_module(module: str, key: str) -> ModuleType:
    """Import a dotted module or a ``.py`` file.

    Raises:
        PluginError: not found, or its import raised (the message names ``key``).
    """
    if is_file_module(module):
        return _load_file(module, key)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise PluginError(key, f"no module named {e.name!r} (importing {module!r}; is it installed "
                               "or on PYTHONPATH?)") from e
    except Exception as e:  # any error inside the user's module, reported with its key
        raise PluginError(key, f"importing {module!r} failed: {type(e).__name__}: {e}") from e


def import_plugins(modules: Iterable[str], key: str = "plugins") -> list[ModuleType]:
    """Import every ``plugins:`` entry in order (their registration decorators run).

    Raises:
        PluginError: an entry that cannot be imported; the key is ``plugins[i]``.
    """
    return [import_module(str(m), f"{key}[{i}]") for i, m in enumerate(modules or [])]


def is_import_path(spec: str) -> bool:
    """``spec`` is ``module:attribute`` rather than a registry name."""
    return ":" in spec


def load_object(spec: str, key: str) -> Any:
    """The object named by ``module:attr`` (``attr`` may be dotted: ``Class.factory``).

    Raises:
        PluginError: the module cannot be imported or has no such attribute.
    """
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise PluginError(key, f"{spec!r} is not an import path (write module:attribute)")
    obj: Any = import_module(module_name, key)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(key, f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve(spec: str, registry: Mapping[str, Any], *, key: str, kind: str) -> Any:
    """A registered object by name, or the object of an import path.

    Args:
        spec: registry name or ``module:attr``.
        registry: name -> object.
        key: the YAML key naming ``spec`` (for errors).
        kind: ``tool``, ``reward``, ... (for errors).

    Raises:
        PluginError: unknown name (the registered ones are listed) or an import path that fails.
    """
    if spec in registry:
        return registry[spec]
    if is_import_path(spec):
        return load_object(spec, key)
    raise PluginError(key, f"unknown {kind} {spec!r}: registered {kind}s are "
                           f"{', '.join(sorted(registry)) or '(none)'}; or give an import path "
                           "module:Name (and list its module under plugins: to register names)")


def _absolute(spec: str) -> str:
    """``spec`` with a relative ``.py`` file part made absolute (names and modules unchanged)."""
    if is_import_path(spec):
        module, _, attr = spec.rpartition(":")
        return f"{_absolute(module)}:{attr}" if is_file_module(module) else spec
    if is_file_module(spec) and not Path(spec).is_absolute():
        return str(Path(spec).resolve())
    return spec


def absolute_specs(cfg: Any) -> None:
    """Make the file paths in ``plugins`` and the plugin names of ``cfg`` absolute, in place, so
    the resolved config means the same thing in every process (whatever its working directory)."""
    if cfg.plugins:
        cfg.plugins = [_absolute(str(m)) for m in cfg.plugins]
    r = cfg.rollout
    r.reward = _absolute(r.reward)
    r.agent.name = _absolute(r.agent.name)
    if any(is_file_module(str(k).rpartition(":")[0]) for k in r.tools):
        r.tools = {_absolute(str(k)): v for k, v in r.tools.items()}
    if cfg.data.dataset:
        cfg.data.dataset = _absolute(cfg.data.dataset)
    a = cfg.algorithm
    a.policy_loss, a.advantage_estimator = _absolute(a.policy_loss), _absolute(a.advantage_estimator)
    a.rollout_correction = _absolute(a.rollout_correction)
    cfg.weight_sync.transport = _absolute(cfg.weight_sync.transport)
    if is_import_path(str(cfg.sft.demonstrations)):  # a file of rows stays as written
        cfg.sft.demonstrations = _absolute(cfg.sft.demonstrations)
