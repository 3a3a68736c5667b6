"""The weight-sync transports ``weight_sync.transport`` names: one :class:`~megarl.registry.Registry`
(:data:`TRANSPORTS`) of :class:`TransportEntry`, each saying which class sends and what validation
and the planner need to know about it.

An entry names its class by import path (the transports live in :mod:`megarl.weight_sync`, a layer
above ``config``), so validation and the planner read what an entry declares without importing a
transport: whether each engine rank receives exactly its slices (the plan's bytes per engine rank),
whether a stage has one sender (``weight_sync.senders_per_stage`` is then 1), which custom weight
loaders engines megarl starts register for it, whether it joins trainer and engine ranks in a process
group (NCCL cannot join two ranks on one GPU: not colocated on CUDA), whether it needs colocated
engines, whether ``weight_sync.senders=owner`` sends through it, and what it falls back to when the
engines did not register megarl's receiver loader. ``weight_sync.transport`` is a registered name,
``auto`` (not an entry: :func:`megarl.weight_sync.choice.resolve_auto` picks per sender), or an
import path ``module:attr`` naming an entry or a transport class (a
:class:`megarl.weight_sync.transport.Transport` subclass, with the default declarations). A plugin
module (``plugins:``) registers a name with :func:`register_transport`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megarl.plugins import load_object
from megarl.registry import Registry

_LOADER = "megarl.weight_sync.sglang_loader.load_presharded"
"""SGLang loads a ``shard`` / ``p2p`` payload pre-sharded (``megarl.weight_sync.sglang_transports.LOADER``)."""
_RECEIVER = "megarl.weight_sync.receiver.receive_shards"
"""megarl's receiver loader of the checked transports (``megarl.weight_sync.receiver.RECEIVER``)."""


@dataclasses.dataclass(frozen=True)
class TransportEntry:
    """A weight-sync transport (``weight_sync.transport``) and what validation and the planner need.

    Attributes:
        cls: the sending class (a ``megarl.weight_sync.transport.Transport`` subclass: its
            ``from_options(plan, engines, options)`` builds one per sender) or its import path ``module:Class``.
        delivers_shards: each engine rank receives exactly its slices (else every tensor whole).
        one_sender: one sender per pipeline stage (shared memory or files): ``senders_per_stage`` is 1.
        engine_loaders: the ``--custom-weight-loader`` paths engines megarl starts register for it.
        process_group: joins trainer and engine ranks in one process group (refused colocated on CUDA).
        colocated_only: hands the engines memory they share: needs ``cluster.placement=colocated``.
        owner_senders: ``weight_sync.senders=owner`` (every rank sends its own parts) works with it.
        unchecked: the class (or import path) used instead when the engines did not register
            megarl's receiver loader; None: ``cls`` always.
    """

    cls: type | str
    delivers_shards: bool = False
    one_sender: bool = False
    engine_loaders: tuple[str, ...] = ()
    process_group: bool = False
    colocated_only: bool = False
    owner_senders: bool = False
    unchecked: type | str | None = None

    @classmethod
    def of(cls, obj: Any) -> TransportEntry:
        """``obj`` if it is an entry, else a transport class wrapped as one (the default declarations).

        Raises:
            TypeError: ``obj`` is neither an entry nor a class with ``from_options``.
        """
        if isinstance(obj, TransportEntry):
            return obj
        if not isinstance(obj, type) or not callable(getattr(obj, "from_options", None)):
            raise TypeError(f"{obj!r} is neither a TransportEntry nor a transport class "
                            "(a megarl.weight_sync.transport.Transport subclass)")
        return cls(obj)

    def load(self, *, unchecked: bool = False) -> type:
        """The sending class (``unchecked``: the fallback's), imported when given by import path.

        Raises:
            PluginError: the import path does not load (names ``weight_sync.transport``).
            ValueError: ``unchecked`` asked of an entry without one.
        """
        target = self.unchecked if unchecked else self.cls
        if target is None:
            raise ValueError(f"transport {self.cls!r} has no unchecked fallback")
        return load_object(target, TRANSPORTS.key) if isinstance(target, str) else target


TRANSPORTS: Registry[TransportEntry] = Registry("weight-sync transport", "weight_sync.transport",
                                                entry_of=TransportEntry.of)
"""``weight_sync.transport`` -> :class:`TransportEntry` (the built-ins below; ``auto`` is not one)."""


def register_transport(name: str, **declared: Any) -> Callable[[type], type]:
    """Decorator registering a transport class as ``name`` with ``declared`` (:class:`TransportEntry`'s fields).

    Raises:
        ValueError: ``name`` is already registered to another transport.
    """
    def decorator(cls: type) -> type:
        TRANSPORTS.add(name, TransportEntry(cls, **declared))
        return cls
    return decorator


def transport_entry(spec: str) -> TransportEntry | None:
    """The entry ``spec`` names; None for ``auto``, an unknown name or an import path that does not
    load (the field's domain and the plugin check report those)."""
    return None if spec == "auto" else TRANSPORTS.get_entry(spec)


def one_sender_per_stage(spec: str) -> bool:
    """``spec`` (a ``weight_sync.transport`` value) has one sender per pipeline stage (False for ``auto``)."""
    entry = transport_entry(spec)
    return entry is not None and entry.one_sender


TRANSPORTS.add("p2p", TransportEntry("megarl.weight_sync.p2p:P2PTransport", delivers_shards=True,
                                     engine_loaders=(_LOADER, _RECEIVER), process_group=True, owner_senders=True))
TRANSPORTS.add("distributed", TransportEntry("megarl.weight_sync.p2p:CheckedDistributedTransport",
                                             engine_loaders=(_RECEIVER,), process_group=True,
                                             unchecked="megarl.weight_sync.sglang_transports:DistributedTransport"))
TRANSPORTS.add("shard", TransportEntry("megarl.weight_sync.sglang_transports:ShardTransport", delivers_shards=True,
                                       one_sender=True, engine_loaders=(_LOADER,)))
TRANSPORTS.add("tensor", TransportEntry("megarl.weight_sync.sglang_transports:TensorTransport", one_sender=True,
                                        colocated_only=True))
TRANSPORTS.add("disk", TransportEntry("megarl.weight_sync.sglang_transports:DiskTransport", one_sender=True))
