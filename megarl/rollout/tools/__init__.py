"""Tools the policy can call (docs/architecture.md ``Tool``), selected by registry name from YAML."""
from megarl.rollout.tools.tool_registry import TOOL_REGISTRY, build_tools, register_tool

# Built-in tools register themselves on import.
from megarl.rollout.tools import calculator, python_sandbox, search  # noqa: F401  isort: skip

__all__ = ["TOOL_REGISTRY", "build_tools", "register_tool"]
