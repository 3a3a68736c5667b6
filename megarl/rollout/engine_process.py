"""Launch, watch, stop and restart SGLang server processes (the rollout engines).

One :class:`EngineProcess` is one ``python -m sglang.launch_server`` process tree (HTTP server,
scheduler per TP rank, detokenizer), started in its own process group so that stopping it never
touches anything else. The same code launches SGLang on CUDA (clusters) and on CPU (tests, CI, the
demo); on CPU it adds SGLang's CPU switches and megarl's CPU shims (:mod:`megarl.rollout.cpu_shims`)
to the *server's* environment only.

Engines that someone else already runs are used by URL (``rollout.external_engine_urls``); they
need no launcher, only a :class:`megarl.rollout.client.SGLangClient`.

Example::

    engine = EngineProcess(model_path, device="cpu", log_path="runs/x/engine0.log")
    engine.start()
    engine.wait_healthy(timeout_s=120)
    ...  # SGLangClient(engine.url)
    engine.stop()
"""
from __future__ import annotations

import atexit
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
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from megarl.procs.ports import find_free_port
from megarl.rollout import cpu_shims
from megarl.rollout.dequantized_view import dequantized_model_dir
from megarl.rollout.engine_resources import _wait_port_free, check_nodes, cpu_threads_bind, local_host, resolve_device
from megarl.rollout.engine_view import served_model_dir

log = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 6000
_LIVE_ENGINES: weakref.WeakSet[EngineProcess] = weakref.WeakSet()


class EngineStartupError(RuntimeError):
    """The SGLang server exited or did not answer ``/health`` in time; the message has its log tail."""


class EngineProcess:
    """One SGLang HTTP server process (tree) on this node.

    Args:
        model_path: Hugging Face model directory served by the engine.
        port: HTTP port; None picks a free one at :meth:`start`.
        host: address to bind and advertise in :attr:`url`; ``auto`` (:data:`AUTO_HOST`) means
            ``127.0.0.1`` here (the Ray actor of a multi-host run resolves it to the node's
            address first: :class:`megarl.rollout.engine_actor.EngineActor`).
        tp_size: tensor-parallel size of the engine (``--tp``).
        ep_size: expert-parallel size within the engine (``--ep-size``; SGLang splits the experts
            over ``ep_size`` of the ``tp_size`` ranks, so it must divide ``tp_size``).
        device: ``auto``, ``cuda`` or ``cpu``. ``cpu`` applies the CPU shims and backends.
        dtype: ``--dtype`` (``auto`` keeps the checkpoint's dtype; ``float32`` for CPU logprob checks).
        mem_fraction_static: ``--mem-fraction-static`` or None for SGLang's default.
        max_total_tokens: ``--max-total-tokens`` (KV cache tokens) or None.
        grammar_backend: ``--grammar-backend`` for constrained decoding (``xgrammar`` works on CPU;
            ``none`` disables regex / json_schema sampling params).
        enable_return_routed_experts: capture routed experts (Rollout Routing Replay).
        custom_weight_loaders: import paths passed to ``--custom-weight-loader``.
        sleep_on_idle: ``--sleep-on-idle`` (SGLang 0.5.23 ``DeviceArgs.sleep_on_idle``): the idle
            scheduler blocks in a ``zmq`` poll on its request sockets (woken by any request, 1 s
            timeout) instead of spinning. Without it an idle scheduler busy-loops on one CPU core
            (measured here: 70-95% of a core for a server that served nothing for minutes), which
            the trainer ranks or the tools sharing the host lose while the engine waits for them.
        nnodes, node_rank, dist_init_addr: an engine spanning ``nnodes`` nodes (SGLang 0.5.23
            ``--nnodes`` / ``--node-rank`` / ``--dist-init-addr``): one such process per node, all
            with the same ``tp_size`` (the whole engine's), each running the ``tp_size / nnodes``
            TP ranks ``node_rank * tp_size / nnodes ...`` of its node. ``dist_init_addr``
            (``host:port``) is where node-rank 0's TP rank 0 hosts torch.distributed's TCP store
            (the same string on every node; may be set after construction, before :meth:`start`). Node-rank 0
            serves HTTP (tokenizer, API); the others
            run only their schedulers and answer ``/health`` on their own ``port`` with a dummy
            server once their schedulers are ready (``entrypoints/engine.py``).
        extra_args: further ``sglang.launch_server`` arguments, verbatim.
        env: extra environment variables for the server process.
        log_path: file receiving the server's stdout and stderr; default a new file under the
            system temp directory.
        engine_id: a name for logs and metrics; default ``engine@host:port``.
        die_with_parent: (Linux) the kernel SIGKILLs the server's main process when the process
            that started it dies, even by SIGKILL or ``os._exit`` (a timed-out pytest), which skips
            ``atexit``. Applied only when :meth:`start` runs on the main thread, because the kernel
            ties this to the starting *thread*.
    """

    def __init__(self, model_path: str | os.PathLike, *, port: int | None = None,
                 host: str = "127.0.0.1", tp_size: int = 1, ep_size: int = 1, device: str = "auto",
                 dtype: str = "auto",
                 mem_fraction_static: float | None = None, max_total_tokens: int | None = None,
                 grammar_backend: str = "xgrammar", enable_return_routed_experts: bool = False,
                 custom_weight_loaders: Sequence[str] = (), sleep_on_idle: bool = True,
                 nnodes: int = 1, node_rank: int = 0, dist_init_addr: str | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike | None = None,
                 engine_id: str | None = None, die_with_parent: bool = True) -> None:
        if tp_size < 1:
            raise ValueError(f"engine tp_size must be >= 1, got {tp_size}")
        if ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"engine ep_size must be >= 1 and divide tp_size={tp_size}, got {ep_size}")
        check_nodes(tp_size, nnodes, node_rank, dist_init_addr)
        self.model_path = str(model_path)
        self.served_path = self.model_path  # what SGLang loads: set at start() (megarl.rollout.engine_view)
        self.host = local_host(host)
        self.port = port
        self.tp_size = tp_size
        self.ep_size = ep_size
        self.device = resolve_device(device)
        self.dtype = dtype
        self.mem_fraction_static = mem_fraction_static
        self.max_total_tokens = max_total_tokens
        self.grammar_backend = grammar_backend
        self.enable_return_routed_experts = enable_return_routed_experts
        self.custom_weight_loaders = list(custom_weight_loaders)
        self.sleep_on_idle = sleep_on_idle
        self.nnodes, self.node_rank, self.dist_init_addr = nnodes, node_rank, dist_init_addr
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self._engine_id = engine_id
        self.die_with_parent = die_with_parent
        self.nccl_port: int | None = None
        """``--nccl-port``: where a one-node engine's TP rank 0 hosts torch.distributed's TCP store
        (SGLang 0.5.23 ``PortArgs.init_new``: ``tcp://127.0.0.1:nccl_port``, used at every TP size).
        Chosen by megarl's port allocator at each :meth:`start`; without it SGLang draws a random port in
        22000-29999 that nothing reserves, which two engines (or an engine and a trainer group taking
        ports from :mod:`megarl.procs.ports`) starting at once on one host can both get."""
        self._proc: subprocess.Popen | None = None
        self._log_file: IO[bytes] | None = None

    # ---------------------------------------------------------------- description
    @property
    def url(self) -> str:
        """``http://host:port`` of the server (the port is fixed at :meth:`start`)."""
        if self.port is None:
            raise RuntimeError("EngineProcess.url is known only after start()")
        return f"http://{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """Name used in logs, metrics and :class:`GenerateOutput.engine_id`."""
        return self._engine_id or f"engine@{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server's main process (also its process-group id), or None."""
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        """The ``sglang.launch_server`` command line."""
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.served_path,
               "--host", self.host, "--port", str(self.port), "--tp", str(self.tp_size),
               # sglang 0.5.23 ServerArgs.ep_size (aliases --ep, --expert-parallel-size)
               "--ep-size", str(self.ep_size),
               "--dtype", self.dtype, "--grammar-backend", self.grammar_backend,
               "--device", self.device]
        if self.device == "cpu":
            # SGLang's torch-native paths; overlap scheduling only helps with a GPU stream.
            cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--disable-overlap-schedule"]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.enable_return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if self.custom_weight_loaders:
            cmd += ["--custom-weight-loader", *self.custom_weight_loaders]
        if self.sleep_on_idle:
            cmd += ["--sleep-on-idle"]
        if self.nccl_port is not None:
            cmd += ["--nccl-port", str(self.nccl_port)]
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                raise ValueError(f"{self.engine_id}: node rank {self.node_rank} of {self.nnodes} has no dist_init_addr")
            check_nodes(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--dist-init-addr", self.dist_init_addr]
        return cmd + self.extra_args

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default ``os.environ``), CPU setup, then ``env``."""
        env = dict(os.environ if base is None else base)
        if self.device == "cpu":
            env = cpu_shims.apply_to_env(env)
            if self.tp_size > 1:  # SGLang checks the engine's whole TP size, binds this node's ranks
                env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(self.tp_size // self.nnodes))
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> EngineProcess:
        """Launch the server in a new process group; returns at once (see :meth:`wait_healthy`).

        Raises:
            RuntimeError: already running, or (CPU) an SGLang version the shims do not support.
        """
        if self.is_alive():
            raise RuntimeError(f"{self.engine_id} is already running (pid {self.pid})")
        if self.device == "cpu":
            cpu_shims.check_sglang_version()
        if self.port is None:
            self.port = find_free_port(self.host)
        if self.nnodes == 1 and "--nccl-port" not in self.extra_args:  # a new one per start: a restart
            self.nccl_port = find_free_port("")  # never waits for the killed store's port; listens on every interface
        model = self.model_path  # block FP8 on CPU: SGLang serves its dequantisation (dequantized_view)
        self.served_path = served_model_dir(dequantized_model_dir(model) if self.device == "cpu" else model)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        log.info("starting %s: %s (log %s)", self.engine_id, " ".join(self.command()), self.log_path)
        on_main_thread = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                                      stdout=self._log_file, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=_kill_with_parent if self.die_with_parent
                                      and on_main_thread and sys.platform == "linux" else None)
        _LIVE_ENGINES.add(self)
        return self

    def is_alive(self) -> bool:
        """The main server process is running (says nothing about readiness; see :meth:`health`)."""
        return self._proc is not None and self._proc.poll() is None

    def health(self, timeout_s: float = 5.0) -> bool:
        """``GET /health`` answered 200 within ``timeout_s``."""
        if self.port is None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> EngineProcess:
        """Block until ``/health`` answers 200.

        Raises:
            EngineStartupError: the process exited, or ``timeout_s`` passed; the server is stopped
                and the error carries the tail of its log.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                code = self._proc.returncode if self._proc else None
                self.stop()
                raise EngineStartupError(f"{self.engine_id} exited with code {code} during start-up; "
                                         f"log {self.log_path}:\n{self.log_tail()}")
            if self.health(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                log.info("%s healthy at %s", self.engine_id, self.url)
                return self
            time.sleep(poll_s)
        self.stop()
        raise EngineStartupError(f"{self.engine_id} did not answer /health within {timeout_s:.0f} s; "
                                 f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server: SIGTERM to its main process (SGLang drains running requests and stops
        its children), then SIGKILL to the whole process group after ``grace_s`` seconds.

        Args:
            grace_s: seconds for the graceful part; 0 kills the process group at once.

        Returns:
            The main process's exit code, or None if it was not started.
        """
        proc, self._proc = self._proc, None
        if proc is not None:
            if grace_s > 0 and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s still running %.0f s after SIGTERM; killing its process group",
                                self.engine_id, grace_s)
            # Children (scheduler, detokenizer) may outlive the main process: always sweep the group.
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE_ENGINES.discard(self)
        return proc.returncode if proc is not None else None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (simulates a crashed engine; see :meth:`stop`)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def restart(self, timeout_s: float = 300.0) -> EngineProcess:
        """Stop (if needed), start on the same port, and wait until healthy.

        The restarted engine serves the weights at ``model_path``; a caller that has pushed newer
        weights must push them again before routing traffic to it.
        """
        self.stop(grace_s=0)
        _wait_port_free(self.host, self.port, timeout_s=30.0)
        return self.start().wait_healthy(timeout_s)

    def log_tail(self, num_bytes: int = _LOG_TAIL_BYTES) -> str:
        """The last ``num_bytes`` of the server log."""
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        with open(self.log_path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - num_bytes))
            return fh.read().decode("utf-8", errors="replace")

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"EngineProcess({self.engine_id}, device={self.device}, tp={self.tp_size}, {state})"


def _kill_with_parent() -> None:
    # Runs in the child between fork and exec: ask for SIGKILL when the parent dies. SGLang's own
    # children watch their parent (the main server process) and exit with it.
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_leftover_engines() -> None:
    # A crashed driver must not leave servers running on the node.
    for engine in list(_LIVE_ENGINES):
        engine.stop(grace_s=0)
