"""Start, check and stop a retrieval service process (:mod:`megarl.retrieval.server`).

Example::

    service = RetrievalProcess("runs/wiki-bm25", corpus="data/corpus.jsonl").start().wait_ready()
    ...  # the search tool: rollout.tools.search.url = service.url
    service.stop()

The process runs in its own process group (stopping it touches nothing else) and logs to a file.
A start-up refusal (index from another corpus, wrong backend) is raised with the process's message.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _kill_with_parent() -> None:
    # Runs in the child between fork and exec: SIGKILL when the parent dies.
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class RetrievalStartupError(RuntimeError):
    """The service exited during start-up or did not answer ``/health`` in time (log tail attached)."""


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, from megarl's allocator (:func:`megarl.procs.ports.find_free_port`:
    reserved on the node, below the kernel's ephemeral range).

    Raises:
        RuntimeError: no free port in the searched range.
    """
    from megarl.procs.ports import find_free_port

    return find_free_port(host)


class RetrievalProcess:
    """One ``python -m megarl.retrieval.server`` process.

    Args:
        index: index directory.
        backend: refuse an index of another backend (None: any).
        corpus: refuse an index built from another corpus file (None: no check).
        corpus_sha256: the same check by hash.
        host: address to bind; port: None = a free one.
        max_batch_queries, max_wait_ms: the server's request coalescing.
        log_path: server log (default: a temporary file).
    """

    def __init__(self, index: str | os.PathLike, *, backend: str | None = None,
                 corpus: str | None = None, corpus_sha256: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, max_batch_queries: int = 64,
                 max_wait_ms: float = 2.0, log_path: str | os.PathLike | None = None) -> None:
        self.index = str(index)
        self.backend, self.corpus, self.corpus_sha256 = backend, corpus, corpus_sha256
        self.host, self.port = host, port
        self.max_batch_queries, self.max_wait_ms = max_batch_queries, max_wait_ms
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the server (the port is known once :meth:`start` picked it)."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (``python -m megarl.retrieval.server ...``)."""
        cmd = [sys.executable, "-m", "megarl.retrieval.server", "--index", self.index,
               "--host", self.host, "--port", str(self.port),
               "--max-batch-queries", str(self.max_batch_queries), "--max-wait-ms", str(self.max_wait_ms)]
        for flag, value in (("--backend", self.backend), ("--corpus", self.corpus),
                            ("--corpus-sha256", self.corpus_sha256)):
            if value:
                cmd += [flag, str(value)]
        return cmd

    def start(self) -> RetrievalProcess:
        """Launch the process; returns at once (see :meth:`wait_ready`)."""
        if self.port is None:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"retrieval-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # The service dies with its owner (a killed driver or Ray actor must not leave it serving).
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only set it from the main thread.
        on_main_thread = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(self.command(), env=env, stdin=subprocess.DEVNULL,
                                          stdout=log_file, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          preexec_fn=_kill_with_parent if on_main_thread
                                          and sys.platform == "linux" else None)
        log.info("retrieval service starting at %s (log %s)", self.url, self.log_path)
        return self

    def health(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """``GET /health``'s JSON, or None when it does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float = 300.0) -> RetrievalProcess:
        """Block until ``/health`` answers.

        Raises:
            RetrievalStartupError: the process exited (e.g. refused the index) or timed out.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self.stop()
                raise RetrievalStartupError(f"retrieval service exited with code {code}: "
                                            f"{self.log_tail()}")
            if self.health(timeout_s=2.0) is not None:
                return self
            time.sleep(0.2)
        self.stop()
        raise RetrievalStartupError(f"retrieval service did not answer /health within {timeout_s:g} s: "
                                    f"{self.log_tail()}")

    def is_alive(self) -> bool:
        """The server process is running (says nothing about readiness)."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL to the process group after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The last ``num_bytes`` bytes of the server's log as text (``<no log>`` when there is none)."""
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        data = self.log_path.read_bytes()[-num_bytes:]
        return data.decode("utf-8", errors="replace")

    def __enter__(self) -> RetrievalProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
