"""Tool registry: YAML ``rollout.tools`` maps registry names (or import paths) to constructor settings.

    rollout:
      tools:
        python: {timeout_s: 5, memory_mb: 512}
        calculator: {}
        my_pkg.tasks:SearchTool: {top_k: 3}      # an import path (see megarl.plugins)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megarl.registry import Registry
from megarl.rollout.types import Tool

TOOL_REGISTRY: Registry[Callable[..., Tool]] = Registry("tool", "rollout.tools")
"""Registry name -> tool class (or factory) taking the YAML settings as keyword arguments."""


def register_tool(name: str) -> Callable[[Callable[..., Tool]], Callable[..., Tool]]:
    """Class decorator adding a tool factory to :data:`TOOL_REGISTRY` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return TOOL_REGISTRY.register(name)


def build_tools(settings: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Tool]:
    """Instantiate the tools named in ``rollout.tools``.

    Args:
        settings: registry name or ``module:Class`` import path -> keyword arguments (None or {}
            for defaults).

    Returns:
        Tool name (as the model calls it) -> tool instance, in the order given.

    Raises:
        ValueError: an unknown tool name or import path (:class:`megarl.plugins.PluginError`), or
            settings the tool rejects (the message names the key).
    """
    tools: dict[str, Tool] = {}
    for name, kwargs in settings.items():
        factory = TOOL_REGISTRY.resolve(str(name), key=f"rollout.tools.{name}")
        try:
            tool = factory(**dict(kwargs or {}))
        except TypeError as e:
            raise ValueError(f"rollout.tools.{name}: {e}") from e
        if not isinstance(tool, Tool):
            raise ValueError(f"rollout.tools.{name}: {type(tool).__name__} is not a Tool")
        tools[tool.name] = tool
    return tools
