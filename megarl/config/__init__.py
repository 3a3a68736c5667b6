"""Typed configuration: schema (dataclasses), YAML + override loading, cross-field validation."""
from megarl.config.loader import ConfigError, ConfigIssue, load_config, save_resolved, to_yaml
from megarl.config.schema import MegarlConfig
from megarl.config.validate import validate

__all__ = ["ConfigError", "ConfigIssue", "MegarlConfig", "load_config", "save_resolved", "to_yaml", "validate"]
