"""The one decorator behind megarl's name registries (tools, rewards, agent loops, datasets,
SFT demonstration builders): ``@register_x("name")`` puts the decorated object into a dict.
No megarl imports here, so any module can use it without an import cycle."""
from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import TypeVar

T = TypeVar("T")


def registrar(registry: MutableMapping[str, T], name: str, kind: str) -> Callable[[T], T]:
    """A decorator that adds its argument to ``registry`` under ``name`` and returns it unchanged.

    Registering the same object twice (a module imported twice) is allowed.

    Raises:
        ValueError: (when decorating) ``name`` is already registered to another object; the message
            names ``kind`` (e.g. ``tool``) and ``name``.
    """
    def decorator(obj: T) -> T:
        if name in registry and registry[name] is not obj:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = obj
        return obj
    return decorator
