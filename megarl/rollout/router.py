"""Route generate calls over many SGLang engines.

Policy:

- **Session affinity.** Every turn of one trajectory (one ``session_id``) goes to the engine that
  served its first turn, so later turns find their history in that engine's prefix (radix) cache.
- **Least outstanding requests.** A new session goes to the live engine with the fewest requests
  in flight (ties: round robin).
- **Draining dead engines.** When a request to an engine fails because the connection was refused
  or lost, the router asks whether the server still answers HTTP
  (:meth:`~megarl.rollout.client.SGLangClient.reachable`; not SGLang's ``/health``, which needs a
  generation and so fails on a paused or busy engine); if it does not, the engine is marked dead and
  gets no further requests. Each unfinished turn it held is sent again to a live engine
  (its session is re-pinned there). A turn is only re-sent after its previous attempt has failed
  without a result, so each ``generate`` call returns exactly one output: nothing is lost and
  nothing is duplicated. If the engine is still healthy (a dropped connection), the old request is
  aborted on it before the turn is re-sent.
- A dead engine comes back only through :meth:`Router.mark_alive` / :meth:`Router.admit`, called by
  whoever restarted it *and* brought its weights up to date (a restarted SGLang server serves its
  launch weights), or found it answering again with the current ``weight_version``
  (``megarl.cluster.ray_engines.heal_engines``).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.rollout.client import EngineError, EngineTimeoutError, EngineUnavailableError, SGLangClient
from megarl.rollout.types import GenerateOutput

log = logging.getLogger(__name__)


@dataclass
class EngineSlot:
    """The router's view of one engine."""

    client: SGLangClient
    alive: bool = True
    num_outstanding: int = 0
    """Requests in flight on this engine now."""
    num_completed: int = 0
    """Generate calls this engine answered."""
    num_failed: int = 0
    """Requests that failed on this engine and were re-routed or raised."""


class Router:
    """A :class:`~megarl.rollout.types.RolloutEngine` over several SGLang engines.

    Args:
        clients: one client per engine.
        max_attempts: attempts per turn before the error is raised (default: engines + 1).
        max_sessions: affinity entries kept (least recently used are forgotten beyond this).
        health_timeout_s: reachability timeout when deciding whether a failing engine is dead.
    """

    def __init__(self, clients: Sequence[SGLangClient], *, max_attempts: int | None = None,
                 max_sessions: int = 1_000_000, health_timeout_s: float = 5.0) -> None:
        if not clients:
            raise ValueError("Router needs at least one engine client")
        ids = [c.engine_id for c in clients]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Router engine ids must be unique, got {ids}")
        self.slots = [EngineSlot(client=c) for c in clients]
        self.max_attempts = max_attempts or len(clients) + 1
        self.max_sessions = max_sessions
        self.health_timeout_s = health_timeout_s
        self.num_rerouted = 0
        """Turns re-sent after a failed attempt."""
        self._sessions: collections.OrderedDict[str, EngineSlot] = collections.OrderedDict()
        self._tie_break = itertools.count()

    # ------------------------------------------------------------------ engines
    @property
    def clients(self) -> list[SGLangClient]:
        """All engine clients, dead ones included (weight sync addresses each engine)."""
        return [s.client for s in self.slots]

    def alive_clients(self) -> list[SGLangClient]:
        """Clients of the engines currently in service."""
        return [s.client for s in self.slots if s.alive]

    def _slot(self, engine: int | str) -> EngineSlot:
        if isinstance(engine, int):
            return self.slots[engine]
        for slot in self.slots:
            if slot.client.engine_id == engine:
                return slot
        raise KeyError(f"no engine {engine!r}; have {[s.client.engine_id for s in self.slots]}")

    def mark_dead(self, engine: int | str, reason: str = "") -> None:
        """Take an engine out of service (its sessions move on their next turn)."""
        slot = self._slot(engine)
        if slot.alive:
            log.warning("router: engine %s marked dead (%s)", slot.client.engine_id, reason)
        slot.alive = False

    def mark_alive(self, engine: int | str) -> None:
        """Put a (restarted, weight-synced) engine back into service."""
        self._slot(engine).alive = True

    async def admit(self, engine: int | str, weight_version: str) -> bool:
        """Put an engine back into service only once it reports ``weight_version``.

        A restarted engine, or one whose weight push failed, may answer with the weights it was
        launched with (or half-updated ones); it serves nothing until its own ``weight_version``
        confirms the current policy. Returns whether it was admitted (it stays out otherwise).
        """
        slot = self._slot(engine)
        try:
            reported = await slot.client.get_weight_version()
        except Exception as e:  # noqa: BLE001 - an engine that cannot say is not admitted
            reported = f"<unreachable: {type(e).__name__}>"
        if str(reported) != str(weight_version):
            log.warning("router: engine %s reports weight_version %s, not %s: kept out of service",
                        slot.client.engine_id, reported, weight_version)
            slot.alive = False
            return False
        slot.alive = True
        return True

    def end_session(self, session_id: str) -> None:
        """Forget a finished trajectory's affinity entry."""
        self._sessions.pop(session_id, None)

    def engine_of(self, session_id: str) -> str | None:
        """Engine id a session is pinned to, or None."""
        slot = self._sessions.get(session_id)
        return slot.client.engine_id if slot else None

    def _pick(self, session_id: str | None) -> EngineSlot:
        if session_id is not None:
            slot = self._sessions.get(session_id)
            if slot is not None and slot.alive:
                self._sessions.move_to_end(session_id)
                return slot
        alive = [s for s in self.slots if s.alive]
        if not alive:
            raise EngineUnavailableError("router: no live engine left "
                                         f"({[s.client.engine_id for s in self.slots]} all dead)")
        start = next(self._tie_break) % len(alive)
        rotated = alive[start:] + alive[:start]
        slot = min(rotated, key=lambda s: s.num_outstanding)
        if session_id is not None:
            self._sessions[session_id] = slot
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return slot

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                       return_routed_experts: bool = False, session_id: str | None = None,
                       **kwargs: Any) -> GenerateOutput:
        """Generate one turn on the session's engine (see the module docstring for failures).

        Args:
            input_ids: ``[P]`` prompt token ids.
            sampling_params: SGLang sampling parameters (not modified).
            return_routed_experts: also return routed experts ``[P + N - 1, L, K]``.
            session_id: trajectory id for engine affinity (None: any engine).
            **kwargs: passed to :meth:`SGLangClient.generate` (``return_logprob``, ...).

        Returns:
            The engine's output; ``engine_id`` says which engine produced it.

        Raises:
            EngineUnavailableError: no live engine is left, or ``max_attempts`` were used up.
            EngineError: a non-connection failure (HTTP error status, timeout on a healthy engine).
        """
        last_error: EngineError | None = None
        for attempt in range(self.max_attempts):
            slot = self._pick(session_id)
            rid = uuid.uuid4().hex
            slot.num_outstanding += 1
            try:
                output = await slot.client.generate(
                    input_ids, sampling_params, return_routed_experts=return_routed_experts,
                    rid=rid, **kwargs)
            except (EngineUnavailableError, EngineTimeoutError) as exc:
                slot.num_failed += 1
                last_error = exc
                if not await self._handle_failure(slot, rid, exc):
                    raise
                self.num_rerouted += 1
                log.info("router: turn of session %s re-sent after %r (attempt %d)",
                         session_id, exc, attempt + 1)
                continue
            finally:
                slot.num_outstanding -= 1
            slot.num_completed += 1
            return output
        raise EngineUnavailableError(f"router: turn failed {self.max_attempts} times; "
                                     f"last error: {last_error}") from last_error

    async def _handle_failure(self, slot: EngineSlot, rid: str, exc: EngineError) -> bool:
        """Decide whether a failed turn may be re-sent; mark the engine dead if it is."""
        if not slot.alive:
            return True  # another request already found it dead
        if await slot.client.reachable(timeout_s=self.health_timeout_s):  # not /health: see reachable
            if isinstance(exc, EngineTimeoutError):
                return False  # a healthy engine that is merely slow: the caller decides
            try:  # the engine lives: make sure the lost attempt stops before re-sending the turn
                await slot.client.abort(rid)
            except EngineError:
                pass
            return True
        self.mark_dead(slot.client.engine_id, repr(exc))
        return True

    # ------------------------------------------------------------------ control
    async def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``method`` on every live engine concurrently; engines found unreachable are
        marked dead, other errors are raised after all calls finished."""
        slots = [s for s in self.slots if s.alive]
        results = await asyncio.gather(*(getattr(s.client, method)(*args, **kwargs) for s in slots),
                                       return_exceptions=True)
        errors = []
        for slot, result in zip(slots, results):
            if isinstance(result, EngineUnavailableError):
                self.mark_dead(slot.client.engine_id, f"{method}: {result!r}")
            elif isinstance(result, BaseException):
                errors.append(result)
        if errors:
            raise errors[0]

    async def pause(self, mode: str = "retract") -> None:
        """Pause generation on every live engine (see :meth:`SGLangClient.pause`)."""
        await self._broadcast("pause", mode)

    async def resume(self) -> None:
        """Continue generation on every live engine."""
        await self._broadcast("resume")

    async def flush_cache(self) -> None:
        """Flush the prefix cache of every live engine."""
        await self._broadcast("flush_cache")

    async def abort_all(self) -> None:
        """Abort every request on every live engine (they return ``finish_reason="abort"``)."""
        await self._broadcast("abort", abort_all=True)

    async def close(self) -> None:
        """Close every client's HTTP session."""
        await asyncio.gather(*(s.client.close() for s in self.slots))

    def metrics(self) -> dict[str, float]:
        """Counters: ``router/rerouted_turns`` (sum), ``router/alive_engines`` (count), per-engine
        ``router/{engine_id}/completed`` (sum) and ``.../outstanding`` (current)."""
        out: dict[str, float] = {"router/rerouted_turns": self.num_rerouted,
                                 "router/alive_engines": sum(s.alive for s in self.slots)}
        for s in self.slots:
            out[f"router/{s.client.engine_id}/completed"] = s.num_completed
            out[f"router/{s.client.engine_id}/outstanding"] = s.num_outstanding
        return out
