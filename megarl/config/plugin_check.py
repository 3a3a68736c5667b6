"""Validation of the user code a config names: ``plugins``, tools, reward, agent loop, dataset reader,
weight-sync transport (the algorithm's policy loss, advantage estimator and rollout correction:
:mod:`megarl.config.algorithm_rules`).

Everything is imported and resolved in the validating process, before any process starts; each
problem names the YAML key that caused it. Protocols are checked on the objects without building
them (no sandbox or worker pool is started): a tool is a class or factory whose settings bind to
its signature and whose ``__call__`` is a coroutine function; a reward class takes
``reward_kwargs`` and is callable, a reward function takes ``(trajectory, sample, **reward_kwargs)``;
an agent loop is ``async def loop(ctx, state)``; a dataset reader takes
``(path, **dataset_kwargs)``; a weight-sync transport is a registry entry or a transport class
(:class:`megarl.config.sync_transports.TransportEntry`); an SFT demonstration builder
(``sft.demonstrations``, unless it names a jsonl/parquet file) takes ``(rows, *, system_prompt, tool_fraction, seed)``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megarl.config.domains import DOMAINS, Registered
from megarl.plugins import PluginError, import_plugins, is_import_path
from megarl.registry import Registry

Issue = tuple[str, str, Any]
"""(key, message, value)."""


def binding_problem(fn: Callable, *args: Any, **kwargs: Any) -> str | None:
    """Why ``fn(*args, **kwargs)`` would be a TypeError (its arguments do not bind to its signature),
    or None (they do, or ``fn`` has no inspectable signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _own_call(cls: type) -> Callable | None:
    """The ``__call__`` a class defines (or inherits from a class other than ``object``)."""
    for klass in cls.__mro__[:-1]:
        if "__call__" in vars(klass):
            return vars(klass)["__call__"]
    return None


def _tool_issue(factory: Any, settings: dict) -> str | None:
    if not callable(factory):
        return f"{factory!r} is not a tool class or factory"
    problem = binding_problem(factory, **settings)
    if problem:
        return f"the settings do not fit {getattr(factory, '__name__', factory)}: {problem}"
    if inspect.isclass(factory):
        call = _own_call(factory)
        if call is None or not inspect.iscoroutinefunction(call):
            return (f"{factory.__name__} is not a Tool: it needs `async def __call__(self, arguments)` "
                    "(plus `name` and an OpenAI-style `schema`)")
    return None


def _reward_issue(spec: str, obj: Any, kwargs: dict) -> str | None:
    if not callable(obj):
        return f"{obj!r} is not callable"
    if inspect.isclass(obj):
        if _own_call(obj) is None:
            return f"{obj.__name__} is not a reward: it needs `__call__(self, trajectory, sample)`"
        problem = binding_problem(obj, **kwargs)
        return f"rollout.reward_kwargs do not fit {obj.__name__}: {problem}" if problem else None
    if is_import_path(spec):  # a function that is the reward itself
        problem = binding_problem(obj, None, None, **kwargs)
        return (f"a reward function is called as fn(trajectory, sample, **reward_kwargs): {problem}"
                if problem else None)
    problem = binding_problem(obj, **kwargs)  # a registered factory
    return f"rollout.reward_kwargs: {problem}" if problem else None


def _agent_issue(loop: Any) -> str | None:
    if not inspect.iscoroutinefunction(loop):
        return f"{getattr(loop, '__name__', loop)!r} is not an agent loop: it needs `async def loop(ctx, state)`"
    problem = binding_problem(loop, None, None)
    return f"an agent loop is called as loop(ctx, state): {problem}" if problem else None


def _dataset_issue(reader: Any, kwargs: dict) -> str | None:
    if not callable(reader):
        return f"{reader!r} is not a dataset reader"
    problem = binding_problem(reader, "path", **kwargs)
    return f"a dataset reader is called as reader(path, **dataset_kwargs): {problem}" if problem else None


def _builder_issue(builder: Any) -> str | None:
    if not callable(builder):
        return f"{builder!r} is not a demonstration builder"
    problem = binding_problem(builder, [], system_prompt=None, tool_fraction=1.0, seed=0)
    return (f"a demonstration builder is called as builder(rows, *, system_prompt, tool_fraction, seed): "
            f"{problem}" if problem else None)


def plugin_issues(cfg: Any) -> list[Issue]:
    """Import ``cfg.plugins`` and check every tool, the reward, the agent loop, the dataset reader, the
    weight-sync transport and the SFT demonstration builder.

    Returns:
        The problems found, each ``(key, message, value)``; empty when all resolve and fit.
    """
    plugins = list(cfg.plugins)
    try:
        import_plugins(plugins)
    except PluginError as e:
        index = int(e.key[e.key.index("[") + 1:-1])
        return [(e.key, e.message, plugins[index])]  # the names below would only fail after it
    from megarl.config.sync_transports import TRANSPORTS
    from megarl.data.datasets import DATASET_REGISTRY
    from megarl.data.demonstrations import DEMONSTRATION_BUILDERS, is_demonstrations_file
    from megarl.rollout.agent import AGENT_REGISTRY
    from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY
    from megarl.rollout.tools import TOOL_REGISTRY

    issues: list[Issue] = []
    r = cfg.rollout

    def check(spec: str, registry: Registry, key: str, protocol: Callable[[Any], str | None]) -> None:
        if isinstance(DOMAINS.get(key), Registered) and not registry.allows(spec):
            return  # an unknown name: the field's domain reports it
        try:
            obj = registry.resolve(spec, key)
        except PluginError as e:
            issues.append((key, e.message, spec))
            return
        problem = protocol(obj)
        if problem:
            issues.append((key, problem, spec))

    for name, settings in r.tools.items():
        check(str(name), TOOL_REGISTRY, f"rollout.tools.{name}",
              lambda f, s=dict(settings or {}): _tool_issue(f, s))  # type: ignore[misc]
    reward_kwargs = dict(r.reward_kwargs or {})
    check(r.reward, REWARD_REGISTRY, "rollout.reward",
          lambda obj: _reward_issue(r.reward, obj, reward_kwargs))
    check(r.agent.name, AGENT_REGISTRY, "rollout.agent.name", _agent_issue)
    dataset_kwargs = dict(cfg.data.dataset_kwargs or {})
    check(cfg.data.dataset, DATASET_REGISTRY, "data.dataset",
          lambda reader: _dataset_issue(reader, dataset_kwargs))
    if cfg.weight_sync.transport != "auto":  # an import path: loads and is a transport (TransportEntry.of)
        check(cfg.weight_sync.transport, TRANSPORTS, "weight_sync.transport", lambda entry: None)
    demonstrations = str(cfg.sft.demonstrations)
    if demonstrations and not is_demonstrations_file(demonstrations):  # a file may be made at run time
        check(demonstrations, DEMONSTRATION_BUILDERS, "sft.demonstrations", _builder_issue)
    return issues
