"""The one registry mechanism behind every extension point megarl selects by name from YAML.

An extension point (policy losses, advantage estimators, rollout corrections, tools, rewards, agent
loops, datasets, SFT demonstration builders, weight-sync transports) is a :class:`Registry`: a dict
of registry name -> entry that knows what it registers (``kind``) and which config field names it
(``key``). Entries register themselves where they are defined (``@REGISTRY.register("name")``, or a
registry's own decorator that wraps the object in an entry declaring what validation needs: a
loss's hyperparameters, an estimator's group size); a config value is either a registered name or an import path
``module:attr`` (:mod:`megarl.plugins`), which :meth:`Registry.resolve` loads and turns into an
entry (``entry_of``). ``megarl.config.domains`` reads a field's choices from its registry, so a name a
plugin registers is valid without touching the config package.

A new extension point adopts it as weight-sync transports did (:mod:`megarl.config.sync_transports`)::

    TRANSPORTS = Registry("weight-sync transport", "weight_sync.transport", entry_of=TransportEntry.of)
    TRANSPORTS.add("p2p", TransportEntry("megarl.weight_sync.p2p:P2PTransport", delivers_shards=True))

and its config field's domain becomes ``Registered(_transports, also=("auto",))``. A registry that
``config`` reads lives at or below ``config``'s layer; an entry may name its object by import path
when that object lives above (the transports do).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from megarl.plugins import PluginError, is_import_path, resolve

T = TypeVar("T")


class Registry(dict[str, T]):
    """Registry name -> entry of one extension point (a ``dict``: ``name in r``, ``r[name]``, ``sorted(r)``).

    Attributes:
        kind: what an entry is, for messages (``policy loss``, ``tool``).
        key: the config field that names an entry (``algorithm.policy_loss``), for messages.
        entry_of: turns the object an import path names into an entry (identity by default; a loss
            registry wraps a bare function in its entry type).
    """

    def __init__(self, kind: str, key: str, entries: Iterable[tuple[str, T]] = (), *,
                 entry_of: Callable[[Any], T] | None = None) -> None:
        super().__init__()
        self.kind, self.key = kind, key
        self.entry_of: Callable[[Any], T] = entry_of or (lambda obj: obj)
        for name, entry in entries:
            self.add(name, entry)

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``; registering an equal entry again (a re-import) is allowed.

        Raises:
            ValueError: ``name`` is already registered to another entry; the message names
                :attr:`kind` and ``name``.
        """
        if name in self and self[name] is not entry and self[name] != entry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator registering its argument itself under ``name`` (see :meth:`add`) and returning it."""
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj
        return decorator

    def allows(self, spec: Any) -> bool:
        """``spec`` is a registered name or has the form of an import path (whether it loads is
        :meth:`resolve`'s to say)."""
        return isinstance(spec, str) and (spec in self or is_import_path(spec))

    def describe(self) -> str:
        """``a registered <kind> (name, ...) or an import path module:name``."""
        return (f"a registered {self.kind} ({', '.join(sorted(self)) or 'none yet'}) or an import path "
                "module:name")

    def resolve(self, spec: str, key: str | None = None) -> T:
        """The entry registered as ``spec``, or the entry of the object the import path ``spec`` names.

        Args:
            spec: a registry name or ``module:attr`` (``module`` dotted or a ``.py`` file).
            key: the YAML key naming ``spec``, for errors (default :attr:`key`).

        Raises:
            PluginError: an unknown name (the registered ones are listed), an import path that does
                not load, or an object :attr:`entry_of` refuses (``TypeError``/``ValueError``); the
                message names ``key``.
        """
        key = key or self.key
        obj = resolve(spec, self, key=key, kind=self.kind)
        if spec in self:
            return obj
        try:
            return self.entry_of(obj)
        except (TypeError, ValueError) as e:
            raise PluginError(key, f"{spec!r} is not a {self.kind}: {e}") from e

    def get_entry(self, spec: str) -> T | None:
        """The entry registered as ``spec`` or named by a loadable import path, else None (no error)."""
        try:
            return self.resolve(spec)
        except PluginError:
            return None
