"""The collector of :class:`~megarl.config.loader.ConfigIssue` that every config rule reports to."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from megarl.config.loader import ConfigIssue


def get_key(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted ``key`` (``parallel.tensor_model_parallel_size``)."""
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


class Checker:
    """Collects issues; ``check(cond, key, message)`` records one when ``cond`` is False."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.issues: list[ConfigIssue] = []

    def check(self, ok: bool, key: str, message: str, value: Any = "__from_cfg__") -> bool:
        """Record a :class:`ConfigIssue` for ``key`` when ``ok`` is False; returns ``ok``.

        Args:
            ok: the rule holds.
            key: dotted config key the issue names (``parallel.tensor_model_parallel_size``).
            message: what is wrong and what would be valid.
            value: the value reported; by default the one at ``key`` in the config (None when the
                config has no such key).
        """
        if not ok:
            if value == "__from_cfg__":
                try:
                    value = get_key(self.cfg, key)
                except Exception:  # noqa: BLE001 - a key missing in the cfg is reported as is
                    value = None
            self.issues.append(ConfigIssue(key, message, value))
        return ok
