"""The ``python`` tool: run untrusted model-written Python in a sandboxed process.

Each call starts ``python -I _sandbox_child.py`` (see that module for the process tree and the
namespaces) with:

- a wall-clock timeout (``timeout_s``) after which the whole session/process group is killed with
  SIGKILL; the PID namespace then takes every descendant with it, fork-bomb orphans included;
- ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_NPROC`` (``max_processes``),
  ``RLIMIT_FSIZE`` and no core files;
- no network (a new network namespace with only a downed loopback);
- a private temporary working directory (a size-limited tmpfs; every other mount read-only);
- home directories hidden (an empty tmpfs over ``/root``, ``/home`` and ``~``; the Python
  installation is bound back if it lives there);
- a clean environment (``PATH``, ``LANG``, ``HOME`` and single-thread BLAS settings only: none of
  the parent's variables, hence none of its secrets) and a fresh ``/proc`` without the parent's;
- its own uid (when megarl runs as root), so it cannot signal or write anything of the host;
- stdout and stderr captured together and truncated to ``max_output_chars``.

Isolation needs root or unprivileged user namespaces. Elsewhere (e.g. a container without
CAP_SYS_ADMIN whose seccomp profile refuses ``unshare``) the sandbox degrades to rlimits, own
session, clean environment and a temporary directory, with no network or filesystem isolation, and
logs a warning once; ``PythonSandboxTool.isolation`` tells which mode ran. In that mode a root
parent still drops the code to its own uid when the interpreter is reachable by other users
(RLIMIT_NPROC and signal protection only hold for non-root uids).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.rollout.tools.tool_registry import register_tool

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_sandbox_child.py")
_SETUP_FAILED = 125
_UID_BASE = 200_000
_uid_counter = itertools.count()
_CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
}


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        output: stdout and stderr interleaved, truncated to the tool's ``max_output_chars``.
        exit_code: the code's exit status; ``128 + n`` when killed by signal n; None on timeout.
        timed_out: the wall-clock limit was hit and the process group was killed.
        duration_s: wall-clock seconds from start to reap.
        truncated: output was longer than the limit.
    """

    output: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool


def _hidden_dirs() -> list[str]:
    """Home directories covered inside the sandbox (credentials, caches, shell history)."""
    dirs = {"/root", "/home", os.path.realpath(os.path.expanduser("~"))}
    return sorted(d for d in dirs if d != "/" and os.path.isdir(d))


def _interpreter_dirs() -> list[str]:
    """The Python installation and virtualenv, which must stay readable even under a home dir."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(dirs)


def _world_traversable(path: str) -> bool:
    """Every directory from / down to ``path`` is world-executable (another uid can reach it)."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(1, len(parts) + 1):
        directory = os.sep.join(parts[:i]) or os.sep
        try:
            if not os.stat(directory).st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


async def _read_capped(stream: asyncio.StreamReader, cap_bytes: int) -> tuple[bytes, bool]:
    """Read until EOF, keeping the first ``cap_bytes`` bytes (the rest is drained and dropped)."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap_bytes - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[:max(room, 0)]
    return bytes(kept), truncated


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@register_tool("python")
class PythonSandboxTool:
    """Code interpreter tool: ``{"code": str}`` -> the program's printed output or an error.

    Args:
        timeout_s: wall-clock limit per call, seconds.
        cpu_s: CPU-time limit (RLIMIT_CPU), seconds.
        memory_mb: address-space limit (RLIMIT_AS), MiB.
        max_processes: process limit (RLIMIT_NPROC) of the sandbox uid.
        max_output_chars: captured output kept (characters of UTF-8 decoded bytes).
        tmpfs_mb: size of the private writable temporary directory, MiB.
        max_concurrency: sandboxes running at once in this process (others wait).
        isolate: use namespaces when the kernel allows (False: rlimits only, for debugging).
    """

    name = "python"

    def __init__(self, *, timeout_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                 max_processes: int = 64, max_output_chars: int = 4096, tmpfs_mb: int = 64,
                 max_concurrency: int = 8, isolate: bool = True) -> None:
        if timeout_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or max_processes <= 0:
            raise ValueError("python tool: timeout_s, cpu_s, memory_mb and max_processes must be > 0")
        self.timeout_s = float(timeout_s)
        self.cpu_s = int(cpu_s)
        self.memory_bytes = int(memory_mb) << 20
        self.max_processes = int(max_processes)
        self.max_output_chars = int(max_output_chars)
        self.tmpfs_bytes = int(tmpfs_mb) << 20
        self.isolate = bool(isolate)
        self.isolation: str | None = None
        """``namespaces`` or ``rlimits-only`` after the first run."""
        self.max_concurrency = int(max_concurrency)
        self._semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run a Python 3 program and return what it prints (stdout and "
                               f"stderr). No network; {timeout_s:g} s time limit.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source."}},
                    "required": ["code"],
                },
            },
        }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Run ``arguments["code"]``; always returns an observation string, never raises."""
        result = await self.run(arguments["code"])
        text = result.output + ("\n[output truncated]" if result.truncated else "")
        if result.timed_out:
            return f"{text}\nError: timed out after {self.timeout_s:g} s (process killed)".lstrip()
        if result.exit_code and result.exit_code > 128:
            sig = result.exit_code - 128
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            return f"{text}\nError: killed by signal {name}".lstrip()
        if result.exit_code:
            return f"{text}\nError: exit code {result.exit_code}".lstrip()
        return text

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` in a fresh sandbox and wait for it (at most ``timeout_s`` + reap time).

        Raises:
            TypeError: ``code`` is not a string.
        """
        if not isinstance(code, str):
            raise TypeError(f"python tool: code must be a string, got {type(code).__name__}")
        loop = asyncio.get_running_loop()  # a semaphore belongs to one event loop
        semaphore = self._semaphores.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with semaphore:
            workdir = tempfile.mkdtemp(prefix="megarl-sandbox-")
            try:
                return await self._run(code, workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, code: str, workdir: str) -> SandboxResult:
        cfg = {"code": code, "cpu_s": self.cpu_s, "memory_bytes": self.memory_bytes,
               "max_processes": self.max_processes, "max_file_bytes": self.tmpfs_bytes,
               "tmpfs_bytes": self.tmpfs_bytes, "isolate": self.isolate,
               "uid": _UID_BASE + next(_uid_counter) % 100_000, "fallback_workdir": workdir,
               "hide_paths": _hidden_dirs(), "expose_paths": _interpreter_dirs(),
               "interpreter_world_readable": all(map(_world_traversable, _interpreter_dirs()))}
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(_CHILD), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=dict(_CLEAN_ENV), cwd=workdir, start_new_session=True, close_fds=True)
        cap_bytes = 4 * self.max_output_chars
        assert proc.stdout is not None and proc.stdin is not None  # both are PIPEs
        reader = asyncio.ensure_future(_read_capped(proc.stdout, cap_bytes))
        timed_out = False
        try:
            proc.stdin.write(json.dumps(cfg).encode())
            await proc.stdin.drain()
            proc.stdin.close()
            await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            timed_out = True
            _kill_group(proc.pid)  # not reaped yet, so the group id is still ours
        except BaseException:
            _kill_group(proc.pid)
            raise
        if not timed_out and self.isolation != "namespaces":
            # Descendants that outlived the code in rlimits-only mode keep the group id reserved,
            # so it still names them (in namespace mode the PID namespace already ended them).
            _kill_group(proc.pid)
        await proc.wait()
        try:
            data, truncated = await asyncio.wait_for(reader, 2.0)
        except TimeoutError:  # rlimits-only mode: an escaped descendant holds the pipe
            reader.cancel()
            data, truncated = b"", False
        text = data.decode("utf-8", errors="replace")
        self._note_isolation(text, proc.returncode)
        if len(text) > self.max_output_chars:
            text, truncated = text[:self.max_output_chars], True
        exit_code = None if timed_out else proc.returncode
        if exit_code is not None and exit_code < 0:  # the bootstrap itself was signalled
            exit_code = 128 - exit_code
        return SandboxResult(output=text, exit_code=exit_code, timed_out=timed_out,
                             duration_s=time.monotonic() - start, truncated=truncated)

    def _note_isolation(self, text: str, returncode: int | None) -> None:
        if self.isolation is not None:
            return
        if "[sandbox] isolation unavailable" in text or not self.isolate:
            self.isolation = "rlimits-only"
            logger.warning("python sandbox: namespaces unavailable; running with rlimits only "
                           "(no network or filesystem isolation)")
        elif returncode != _SETUP_FAILED:
            self.isolation = "namespaces"
