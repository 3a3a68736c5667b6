"""Run a function on N local ranks (spawned processes, gloo) with a hard timeout.

Used by multi-process tests, benchmarks and the CPU checkpoint converter::

    def worker(rank, world_size, hf_dir):   # module-level, so that spawn can import it
        ...                                 # torch.distributed is initialised (gloo)
        return some_picklable_result

    results = run_ranks(worker, 2, args=(hf_dir,), timeout_s=120)   # [result_rank0, result_rank1]

Guarantees: every child is killed when the call returns or raises (a rank that dies or raises
never leaves its peers hanging in a collective); ``OMP_NUM_THREADS=1`` in the children unless
given; the rendezvous is a file store in a private temporary directory (no port races with other
test runs on the same machine).

Start method: ``forkserver`` by default, with torch and Megatron-Core preloaded in the server
(:mod:`megarl.procs.local_ranks_preload`), and the modules the caller names in ``preload`` (what its
rank function imports: the converter passes Megatron's model builder and the families' HF configs),
imported once per calling process (~10 s on 2 busy cores) instead of once per rank and call. The
server starts on a process's first ``forkserver`` call: that call's ``preload`` holds for the
process. ``spawn`` is available for code that must not share the server's imports, and is the default
where CUDA is available: importing Megatron-Core in the server can initialise CUDA there, and every
rank forked from it then fails its first CUDA call with "Cannot re-initialize CUDA in forked
subprocess" (seen on an H100 in ``tools/gpu_check.sh``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from megarl.procs.ports import find_free_port


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message holds each failed rank's traceback."""


def free_port() -> int:
    """A TCP port for ``MASTER_PORT`` on this host, from megarl's allocator
    (:func:`megarl.procs.ports.find_free_port`: below the kernel's ephemeral range, reserved on the
    node, so two groups starting at once never get the same one).

    Raises:
        RuntimeError: no free port in the searched range.
    """
    return find_free_port("127.0.0.1")


PRELOAD = ("megarl.procs.local_ranks_preload",)
"""Modules the fork server imports first, before the caller's (see :mod:`megarl.procs.local_ranks_preload`)."""


def default_start_method() -> str:
    """``spawn`` where torch sees a CUDA device (a forked rank cannot use CUDA once the fork server
    has initialised it), else ``forkserver`` (ranks share the server's preloaded imports)."""
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def _context(start_method: str, preload: Sequence[str]):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def _child(fn, rank: int, world_size: int, args: tuple, store_path: str, backend: str | None,
           env: dict, results) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    from megarl.logging_setup import install as filter_known_noise

    filter_known_noise()  # a fresh process: megarl's filter of known third-party console noise
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

        if backend is not None:
            dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                    world_size=world_size)
        out = fn(rank, world_size, *args)
        payload = pickle.dumps(out)
        results.put((rank, True, payload))
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which kills the peers
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *, args: Sequence = (),
              timeout_s: float = 120.0, backend: str | None = "gloo",
              env: dict[str, str] | None = None, start_method: str | None = None,
              preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: number of ranks.
        args: extra positional arguments (picklable).
        timeout_s: wall-clock limit for the whole run, in seconds.
        backend: ``torch.distributed`` backend initialised before ``fn`` runs (None = none).
        env: extra environment variables for the children (``OMP_NUM_THREADS`` defaults to 1;
            ``MASTER_ADDR``/``MASTER_PORT`` are set to a free local port).
        start_method: ``forkserver`` or ``spawn``; None (default) takes :func:`default_start_method`
            (``spawn`` where CUDA is available, else ``forkserver``; see the module docstring).
        preload: modules (dotted names) the fork server imports once after :data:`PRELOAD`, when
            this call starts it; one that raises ImportError is skipped (the rank imports it itself).

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        RankError: a rank raised or exited without a result (message: its traceback or exit
            code), or the run exceeded ``timeout_s`` (message: the unfinished ranks).
    """
    ctx = _context(start_method or default_start_method(), preload)
    child_env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    child_env.update(env or {})
    results = ctx.Queue()
    procs: list = []
    done: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="megarl_ranks_") as tmp:
        store = os.path.join(tmp, "store")
        try:
            for rank in range(world_size):
                proc = ctx.Process(target=_child, args=(fn, rank, world_size, tuple(args), store,
                                                        backend, child_env, results), daemon=True)
                proc.start()
                procs.append(proc)
            deadline = time.monotonic() + timeout_s
            _collect(procs, results, done, deadline=deadline, timeout_s=timeout_s)
            for proc in procs:
                proc.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
            results.close()
    return [done[r] for r in range(world_size)]


def _collect(procs: list, results, done: dict[int, Any], *, deadline: float, timeout_s: float) -> None:
    """Fill ``done`` (rank -> result) from the ranks' reports until every rank has reported.

    Raises:
        RankError: a rank raised, died without a result (after a 2 s grace for its report), or
            ``deadline`` (``timeout_s`` after the start) passed.
    """
    world_size = len(procs)
    grace_until = None  # a rank died: its report may still be in flight
    while len(done) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = _dead_rank(procs, done)
            if dead is not None:
                grace_until = grace_until or time.monotonic() + 2.0
                if time.monotonic() > grace_until:
                    raise RankError(f"rank {dead} exited with code "
                                    f"{procs[dead].exitcode} without a result") from None
            if time.monotonic() > deadline:
                pending = [r for r in range(world_size) if r not in done]
                raise RankError(f"ranks {pending} did not finish within {timeout_s:.0f} s") from None
            continue
        if not ok:
            raise RankError(f"rank {rank} of {world_size} raised:\n{payload}")
        done[rank] = pickle.loads(payload)


def _dead_rank(procs, done) -> int | None:
    for rank, proc in enumerate(procs):
        if rank not in done and not proc.is_alive() and proc.exitcode is not None:
            return rank
    return None
