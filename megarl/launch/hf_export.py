"""HF exports during training, off the driver loop (``checkpoint.hf_export_interval``).

The export of a committed checkpoint (:func:`megarl.conversion.convert.megatron_to_hf_dir`) runs
in its own processes, split into parts: each reads ~1/parts of the model's layers from the
checkpoint and writes its own safetensors shards, and the index is merged from what they return
(:mod:`megarl.conversion.parallel_export`), so it takes as long as one part reading and writing its
share. Where the parts run:

- Ray connected and spanning several live nodes (a multi-node run): on every node, up to
  :func:`export_ranks` parts each (fewer where that node's available memory or CPUs hold fewer),
  one Ray task per node pinned to it (:mod:`megarl.conversion.ray_export`), so no one node's disk
  or NIC carries the whole model. The checkpoint and ``run_dir/hf`` must be on a filesystem every
  node mounts (a multi-node run's run directory is); a node that cannot see them fails the export
  with an error naming it (retried and reported below, like any failure).
- Otherwise: :func:`export_ranks` gloo ranks on the driver's machine, fewer where its available
  memory would not hold each rank's layers in flight, spawned by
  :func:`megarl.procs.local_ranks.run_ranks`.

Waited for in the driver loop, the trainer ranks sat idle meanwhile; here a daemon thread of the
driver waits for those processes (or Ray tasks) while the loop goes on (rollouts, training, weight
syncs).
Its time limit is sized from the checkpoint's bytes (a floor rate per rank far under the measured
one, :func:`megarl.conversion.parallel_export.export_timeout_s`): a hung export (a stalled
filesystem) is ended and retried rather than holding up, forever, the next checkpoint's commit.

Why this is safe:

- The export reads only the checkpoint directory and writes only ``run_dir/hf/step_N`` (into a
  temporary sibling, renamed at the end), nothing the trainer or the engines touch. The thread
  itself only waits on child processes or Ray tasks (which reserve no CPU, so they never wait for
  the run's actors): it holds no lock the loop needs and no CUDA context.
- Checkpoint rotation (``checkpoint.keep_last``) could delete the directory being read: the driver
  waits for the export in flight before it commits the next checkpoint (:meth:`wait`), which is
  when rotation runs. One export at a time: :meth:`start` waits for the previous one.
- A failed export never stops training: it is retried (:data:`EXPORT_ATTEMPTS` tries in all, the
  checkpoint it reads still there), then logged as an error and counted (:attr:`BackgroundExport.failures`);
  the next checkpoint's export goes ahead as usual. The driver's :meth:`wait` before a commit
  returns the error instead of raising it; only the end of the run (the last export) raises it,
  after training finished, so a run whose final weights were not exported does not exit 0.
- Preemption: the export of the last checkpoint is waited for at the end of the run as before;
  a job killed meanwhile leaves no partial ``hf/step_N`` (the rename never happens) and the
  checkpoint itself is already committed.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("megarl.train")

EXPORT_ATTEMPTS = 2
"""Tries of one export (the first and one retry) before it is reported failed."""
MAX_EXPORT_RANKS = 8
"""Export processes at most (fewer on a machine with fewer CPUs): each reads and writes its share."""


def export_ranks(cpu_count: int | None = None) -> int:
    """Export processes on this machine: :data:`MAX_EXPORT_RANKS`, at most one per CPU."""
    return max(1, min(MAX_EXPORT_RANKS, cpu_count or os.cpu_count() or 1))


def _export(ckpt: Path, out: Path, ranks: int = 1) -> None:
    import json

    from megarl.conversion.convert import (
        HF_CONFIG_SUBDIR,
        megatron_to_hf_dir,
        megatron_to_hf_dir_on_nodes,
        resolve_checkpoint_dir,
    )
    from megarl.conversion.parallel_export import available_memory_bytes, checkpoint_bytes, ranks_within_memory
    from megarl.conversion.ray_export import export_nodes

    nodes = export_nodes()
    if nodes:  # Ray spans several nodes: a few parts on each (each node's memory checked there)
        megatron_to_hf_dir_on_nodes(ckpt, out, nodes, overwrite=True, ranks=ranks)
        return
    model = resolve_checkpoint_dir(ckpt)
    config = model / HF_CONFIG_SUBDIR / "config.json"  # missing: megatron_to_hf_dir says what to do
    num_layers = json.loads(config.read_text())["num_hidden_layers"] if config.is_file() else 1
    fit = ranks_within_memory(checkpoint_bytes(model), num_layers, available_memory_bytes(), ranks)
    if fit < ranks:
        logger.warning("HF export of %s: %d ranks, not %d: host memory holds that many ranks' layers", ckpt, fit, ranks)
    # config and tokenizer: the checkpoint's hf_config/; the time limit: sized from its bytes
    megatron_to_hf_dir(ckpt, out, overwrite=True, ranks=fit)


class BackgroundExport:
    """At most one HF export in flight, in a daemon thread.

    Args:
        export: ``export(ckpt_dir, out_dir)``, the blocking export (default: ``megatron_to_hf_dir``
            with the checkpoint's stored HF config, overwriting ``out_dir``, at :attr:`ranks` ranks).
        attempts: tries per export before it is reported failed.
        ranks: processes of the default export (:func:`export_ranks`; per node when Ray spans several).
    """

    def __init__(self, export: Callable[[Path, Path], None] | None = None, attempts: int = EXPORT_ATTEMPTS,
                 ranks: int | None = None) -> None:
        self.ranks = export_ranks() if ranks is None else int(ranks)
        self._export = export or (lambda ckpt, out: _export(ckpt, out, self.ranks))
        self.attempts = int(attempts)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.failures: list[tuple[str, str]] = []
        """``(checkpoint name, error)`` of every export that failed all its tries."""

    @property
    def in_flight(self) -> bool:
        """Whether an export is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, ckpt: Path, out: Path) -> None:
        """Export ``ckpt`` to ``out`` in the background (after the previous export finished; its
        error, already logged and counted, is dropped: this export goes ahead)."""
        self.wait(raise_error=False)

        def work() -> None:
            start = time.perf_counter()
            for attempt in range(1, self.attempts + 1):
                try:
                    self._export(ckpt, out)
                    break
                except BaseException as e:  # noqa: BLE001 - retried, then handed to the driver at the next wait()
                    logger.error("HF export of %s failed (try %d of %d): %s", ckpt, attempt, self.attempts, e)
                    if attempt == self.attempts:
                        self._error = e
                        self.failures.append((ckpt.name, repr(e)))
                        return
            logger.info("exported %s in %.1fs in the background (loadable with transformers / servable by "
                        "SGLang)", out, time.perf_counter() - start)

        self._thread = threading.Thread(target=work, name=f"hf-export-{ckpt.name}", daemon=True)
        self._thread.start()

    def wait(self, *, raise_error: bool = True) -> BaseException | None:
        """Block until the export in flight (if any) finished.

        Args:
            raise_error: raise the export's error (else return it).

        Returns:
            The export's error when ``raise_error`` is False, else None.

        Raises:
            Exception: what the export raised (``RankError``, ``ConfigMismatchError``, ``OSError`` ...).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error
        return error
