"""Stateful tools: a per-trajectory session (a sandbox, a browser, a repository checkout).

A tool opts in by defining any of

    async def create(self, session: ToolSession) -> None     # set session.state
    async def release(self, session: ToolSession) -> None    # free it
    async def __call__(self, arguments, *, session: ToolSession) -> str

Lifecycle, per trajectory and tool: the session is created lazily, on the trajectory's first call of
that tool (a trajectory that never calls it costs nothing), inside that call's time limit
(``rollout.agent.tool_timeout_s``); every later call of the trajectory gets the same session. When the
trajectory ends, however it ends (an answer, truncation, an engine abort, over-sampling
cancellation, a tool timeout, a crash of the tool, the engine or the agent loop), the agent loop
releases its sessions: :meth:`ToolSessions.release_all` calls ``release`` once for every session whose
``create`` was started, even one that raised or timed out (``release`` must tolerate a partly built
``session.state``). A release runs shielded from cancellation, bounded by ``release_timeout_s``; its
failure is logged and counted in ``metadata["tool_release_errors"]``, never raised.

An aborted trajectory that is resumed later (``rollout.partial_rollouts``) was released when it
was aborted; its next call creates a fresh session.

A tool with none of these methods is called as before (``await tool(arguments)``).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.types import Tool

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ToolSession:
    """One stateful tool's session in one trajectory.

    Attributes:
        trajectory_id: unique id of the trajectory (also its engine session id).
        group_id: the prompt group it belongs to.
        sample: the dataset row of the prompt (read it, do not modify it).
        metadata: the trajectory's running statistics (``Trajectory.metadata``).
        tool_name: the tool's name, as the model calls it.
        state: whatever the tool's ``create`` puts here (None before).
    """

    trajectory_id: str
    group_id: int
    sample: Mapping[str, Any]
    metadata: dict[str, Any]
    tool_name: str
    state: Any = None


def is_stateful(tool: Any) -> bool:
    """The tool defines ``create`` / ``release`` or takes a ``session`` keyword in ``__call__``."""
    if callable(getattr(tool, "create", None)) or callable(getattr(tool, "release", None)):
        return True
    try:
        return "session" in inspect.signature(tool.__call__).parameters
    except (TypeError, ValueError):
        return False


class _SessionBound:
    """A stateful tool seen by one trajectory: ``await bound(arguments)`` creates the session on
    first use, then calls ``tool(arguments, session=...)``."""

    def __init__(self, tool: Tool, sessions: ToolSessions) -> None:
        self.tool = tool
        self.name = tool.name
        self.schema = tool.schema
        self._sessions = sessions

    async def __call__(self, arguments: dict[str, Any]) -> str:
        session = await self._sessions.session_for(self.tool)
        return await self.tool(arguments, session=session)  # type: ignore[call-arg]  # a session tool takes it


@dataclass(kw_only=True)
class ToolSessions:
    """The sessions of one trajectory's stateful tools.

    Args:
        trajectory_id, group_id, sample, metadata: see :class:`ToolSession`.
        release_timeout_s: limit of one ``release`` call.
    """

    trajectory_id: str
    group_id: int
    sample: Mapping[str, Any]
    metadata: dict[str, Any]
    release_timeout_s: float = 60.0
    _open: dict[str, tuple[Any, ToolSession]] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def bind(self, tools: Mapping[str, Tool]) -> dict[str, Tool]:
        """``tools`` with every stateful tool wrapped to run in this trajectory's session."""
        return {name: _SessionBound(tool, self) if is_stateful(tool) else tool for name, tool in tools.items()}

    async def session_for(self, tool: Any) -> ToolSession:
        """This trajectory's session of ``tool``, created on first use (once, also when two calls
        of one turn race for it)."""
        name = tool.name
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._open:
                session = ToolSession(trajectory_id=self.trajectory_id, group_id=self.group_id,
                                      sample=self.sample, metadata=self.metadata, tool_name=name)
                self._open[name] = (tool, session)  # before create: a failed create is released too
                create = getattr(tool, "create", None)
                if callable(create):
                    await create(session)
            return self._open[name][1]

    async def release_all(self) -> None:
        """Release every session (shielded from cancellation); errors are logged and counted."""
        opened, self._open = list(self._open.values()), {}
        if not opened:
            return
        await asyncio.shield(asyncio.ensure_future(self._release(opened)))

    async def _release(self, opened: list[tuple[Any, ToolSession]]) -> None:
        async def one(tool: Any, session: ToolSession) -> None:
            release = getattr(tool, "release", None)
            if not callable(release):
                return
            try:
                await asyncio.wait_for(release(session), self.release_timeout_s)
            except Exception as e:  # noqa: BLE001 - a failed release must not fail the trajectory
                logger.warning("tool %s: release of trajectory %s failed: %s: %s", session.tool_name,
                               session.trajectory_id, type(e).__name__, e)
                self.metadata["tool_release_errors"] = self.metadata.get("tool_release_errors", 0) + 1

        await asyncio.gather(*(one(tool, session) for tool, session in opened))


def sessions_of(state: Any) -> ToolSessions:
    """The :class:`ToolSessions` of an agent loop's ``TrajectoryState`` (created on first use)."""
    if state.tool_sessions is None:
        state.tool_sessions = ToolSessions(trajectory_id=state.session_id, group_id=state.group_id,
                                           sample=state.sample, metadata=state.metadata)
    return state.tool_sessions


async def release_sessions(state: Any) -> None:
    """Release the trajectory's tool sessions, if any (the agent loop's ``finally``)."""
    sessions, state.tool_sessions = state.tool_sessions, None
    if sessions is not None:
        await sessions.release_all()
