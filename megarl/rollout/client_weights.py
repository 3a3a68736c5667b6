"""The weight-update endpoints of :class:`~megarl.rollout.client.SGLangClient` (SGLang 0.5.23).

Update sessions, the trainer-engine process group, the three ways tensors reach the engine
(``/update_weights_from_distributed``, ``/update_weights_from_tensor``,
``/update_weights_from_disk``), the weight version and the teacher-forced logprobs a sync is
verified with. They share the client's transport and its failure policy (module docstring of
:mod:`megarl.rollout.client`); an endpoint answering ``{"success": false}`` raises
:class:`~megarl.rollout.engine_errors.EngineRequestError`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.rollout.payloads import serialize_named_tensors


class WeightUpdateEndpoints:
    """Mixin of :class:`~megarl.rollout.client.SGLangClient`: the weight-update endpoints, sent with
    the client's ``_post(path, payload, **kwargs)`` and ``_post_checked(path, payload, **kwargs)``."""

    async def _post(self, path: str, payload: Any = None, **kwargs: Any) -> Any:
        raise NotImplementedError  # SGLangClient's transport

    async def _post_checked(self, path: str, payload: Any, **kwargs: Any) -> dict:
        raise NotImplementedError  # SGLangClient's transport

    async def flush_cache(self) -> Any:
        """SGLang's ``/flush_cache`` (drop the radix cache); the server's JSON answer."""
        raise NotImplementedError  # SGLangClient's

    async def begin_weight_update(self, selector: str = "all") -> dict:
        """Open a weight-update session (required around tensor / distributed updates in 0.5.23)."""
        return await self._post_checked("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict:
        """Close the weight-update session opened by :meth:`begin_weight_update`."""
        return await self._post_checked("/end_weight_update", {})

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        """Make the engine's TP ranks join a process group with the trainer.

        Engine rank ``tp_rank`` becomes group rank ``rank_offset + tp_rank`` of ``world_size``;
        the caller must join concurrently (this call returns when the group is formed).
        ``backend``: ``nccl`` on GPU, ``gloo`` on CPU.
        """
        return await self._post_checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Leave and destroy the weight-update process group."""
        return await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *,
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None,
                                              flush_cache: bool = True,
                                              load_format: str | None = None) -> dict:
        """Receive full HF-named tensors broadcast by group rank 0 (the caller broadcasts
        concurrently, in ``names`` order; ``load_format="flattened_bucket"`` = one flat buffer).

        SGLang ignores names it does not know and still reports success: verify by logprobs.
        """
        payload = {"names": list(names), "dtypes": list(dtypes),
                   "shapes": [list(s) for s in shapes], "group_name": group_name,
                   "flush_cache": flush_cache, "weight_version": weight_version}
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._post_checked("/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(
            self, per_rank: Sequence[str | Sequence[tuple[str, torch.Tensor]]], *,
            load_format: str | None = None, flush_cache: bool = True,
            weight_version: str | None = None) -> dict:
        """Load tensors into the engine, one payload per engine TP rank.

        Args:
            per_rank: element ``r`` goes to TP rank ``r`` only: either ``[(hf_name, tensor), ...]``
                (serialised here with :func:`serialize_named_tensors`) or an already serialised
                payload string.
            load_format: None (full HF tensors, SGLang slices them), ``direct`` (engine-internal
                layout), ``flattened_bucket``, or a ``--custom-weight-loader`` import path.
        """
        payloads = [p if isinstance(p, str) else serialize_named_tensors(p) for p in per_rank]
        payload = {"serialized_named_tensors": payloads, "flush_cache": flush_cache,
                   "weight_version": weight_version}
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._post_checked("/update_weights_from_tensor", payload)

    async def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                       weight_version: str | None = None,
                                       flush_cache: bool = True) -> dict:
        """Reload all weights from a model directory the engine can read, then (``flush_cache``)
        empty the prefix cache with :meth:`flush_cache`, which waits for running requests.

        SGLang 0.5.23's own ``flush_cache`` flag of this endpoint does not wait: with a request
        still running or queued (a health probe, a client that timed out while its request
        stayed queued) it loads the weights and answers HTTP 400 "the cache was not flushed".

        Raises:
            EngineRequestError: the engine refused the load, or requests were still running after
                the flush's wait.
        """
        payload = {"model_path": str(model_path), "weight_version": weight_version, "flush_cache": False}
        if load_format is not None:
            payload["load_format"] = load_format
        result = await self._post_checked("/update_weights_from_disk", payload)
        if flush_cache:
            await self.flush_cache()
        return result

    async def update_weight_version(self, version: str) -> dict:
        """Set the engine's ``weight_version`` (reported in every response's ``meta_info``) without
        aborting running requests."""
        return await self._post_checked("/update_weight_version",
                                        {"new_version": str(version), "abort_all_requests": False})

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> list[float]:
        """Teacher-forced logprobs of ``input_ids[1:]`` under the engine's current weights.

        Returns:
            ``[P - 1]`` floats: ``log p(input_ids[t] | input_ids[:t])`` for ``t = 1 .. P-1``.
        """
        result = await self._post("/generate", {
            "input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        entries = result["meta_info"]["input_token_logprobs"]
        return [float(e[0]) for e in entries[1:]]
