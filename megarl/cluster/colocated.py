"""Colocated placement: the engines give their GPU memory to the trainer while it trains.

Engines run with ``--enable-memory-saver`` on CUDA (:data:`megarl.cluster.ray_engines.MEMORY_SAVER_FLAG`).
At start (:meth:`megarl.launch.run.Run.build`, through :class:`EngineMemoryLoan`) the engines, once
ready, release everything before the trainer ranks are built, and resume before the first weight sync
(which rewrites the weights): the trainer is never built beside their KV cache. While the engines hold
their memory (rollout,
weight sync) the trainer keeps its share, enforced on the device: ``rollout.engine.mem_fraction_static``
+ ``cluster.colocated_trainer_memory_fraction`` must fit the GPU, and the trainer's planned resident
memory its fraction (``megarl validate``, `megarl.plan.fit`).
Around each train step (synchronous mode; the engines are idle once the step's rollout is done):

1. :func:`release` — ``/release_memory_occupation`` of ``kv_cache`` and ``cuda_graph``, and of
   ``weights`` when the step ends with a weight sync (released weights come back uninitialised;
   the sync rewrites every one of them), then the trainer ranks' memory cap is lifted: the trainer
   computes logprobs and trains;
2. :func:`resume` — every trainer rank offloads what ``cluster.colocated_offload`` names (restored
   after the next release), releases its cached CUDA blocks and is capped at
   ``cluster.colocated_trainer_memory_fraction`` of its GPU (`megarl.training.memory_limit`), then
   ``/resume_memory_occupation`` of ``weights`` first, then of the rest, before the weight sync (it
   flushes the prefix cache, and its verification runs the engines' forward);
3. the weight sync, then the next rollout.

SGLang's scheduler refuses a release while it has requests and a resume of a tag that was not
released (it keeps the set of released tags), so the two resumes must follow one release.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

WEIGHT_TAGS = ("weights",)
REST_TAGS = ("kv_cache", "cuda_graph")
"""With ``weights``, SGLang's ``GPU_MEMORY_ALL_TYPES`` (``sglang.srt.constants``)."""


def release(engine_urls: Sequence[str], *, weights: bool, trainer: Any = None) -> tuple[str, ...]:
    """Free every engine's KV cache and CUDA graphs (and weights); engines must be idle. Then lift the
    trainer ranks' memory cap (``trainer.colocated_memory(False)``), when a trainer is given.

    Returns:
        The tags released (what :func:`resume` takes).
    """
    tags = (WEIGHT_TAGS if weights else ()) + REST_TAGS
    _call(engine_urls, "release_memory_occupation", tags)
    if trainer is not None:
        trainer.colocated_memory(False)
    return tags


def resume(engine_urls: Sequence[str], tags: Sequence[str], *, trainer: Any = None) -> None:
    """Re-allocate what :func:`release` freed: weights first (the largest, and the sync's target),
    then the KV cache and CUDA graphs. First, when a trainer is given, every trainer rank releases
    its cached blocks and is capped at ``cluster.colocated_trainer_memory_fraction`` of its GPU
    (``trainer.colocated_memory(True)``, `megarl.training.memory_limit`): the engines get back what
    they lent."""
    if trainer is not None:
        trainer.colocated_memory(True)
    weights = [t for t in tags if t in WEIGHT_TAGS]
    if weights:
        _call(engine_urls, "resume_memory_occupation", weights)
    rest = [t for t in tags if t not in WEIGHT_TAGS]
    if rest:
        _call(engine_urls, "resume_memory_occupation", rest)


def _call(engine_urls: Sequence[str], method: str, tags: Sequence[str]) -> None:
    from megarl.weight_sync.engine_clients import EngineClients

    with EngineClients(list(engine_urls)) as engines:
        engines.call_all(method, list(tags))


def lends_engine_memory(cluster: Any, rollout: Any) -> bool:
    """Whether the engines lend their GPU memory to the trainer: colocated placement
    (``cluster.placement``), synchronous rollouts, engines megarl launched (not
    ``rollout.external_engine_urls``)."""
    return cluster.placement == "colocated" and not rollout.async_mode and not rollout.external_engine_urls


@dataclasses.dataclass
class EngineMemoryLoan:
    """The engines' GPU memory lent to the trainer (module docstring), and what is on loan."""

    lends: bool
    """:func:`lends_engine_memory`; False makes every call a no-op."""
    weights_each_step: bool
    """Every RL step ends with a weight sync (``weight_sync.every_n_steps == 1``): the weights are
    lent too at each step (the sync rewrites them)."""
    engine_urls: Sequence[str] = ()
    """The engines that lend."""
    trainer: Any = None
    """The trainer group (its ranks' memory cap is set around the loan)."""
    released: tuple[str, ...] = ()
    """The SGLang memory tags on loan (empty: none)."""

    def release(self, *, weights: bool | None = None) -> None:
        """The engines (idle: before the first rollout, or after the step's rollout) free their GPU
        memory for the trainer until :meth:`resume`.

        Args:
            weights: lend the weights too (they come back uninitialised: only when the next weight
                sync rewrites them); None: ``weights_each_step``.
        """
        if self.lends:
            weights = self.weights_each_step if weights is None else weights
            self.released = release(self.engine_urls, weights=weights, trainer=self.trainer)

    def resume(self) -> None:
        """Give the engines their memory back (weights, then KV cache and CUDA graphs); no-op if none is lent."""
        if self.released:
            resume(self.engine_urls, self.released, trainer=self.trainer)
            self.released = ()
