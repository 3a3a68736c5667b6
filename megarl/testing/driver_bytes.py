"""Count the bytes of one RL step's trainer calls through a real `TrainerGroup` (issue 25, part 1).

Used by ``tests/integration/launch/test_driver_bytes.py`` and ``tools/benchmarks/driver_bytes.py``.
Sizes are pickled sizes (protocol 5, what Ray's serializer writes for these objects up to its
framing): what the driver puts in the object store (`ray.put`, one shard per data-parallel rank),
what each rank reads (its shard plus the payload of its sequences' R3 routes, ``nbytes``: at
real scale a trajectory's routes are megabytes and the per-object framing vanishes; the old path
is counted alike: the batch plus its packed routes' payload), and what the driver gets back
(`TrainerGroup._gather` results). The old whole-batch path is sized from the same batch: every rank
read the whole batch and returned it prepared (old logprobs and routes filled).
"""
from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch


def pickled_bytes(obj: Any) -> int:
    """``len(pickle.dumps(obj, protocol=5))``."""
    return len(pickle.dumps(obj, protocol=5))


@contextlib.contextmanager
def counting(group: Any) -> Iterator[dict[str, list[int]]]:
    """Record ``ray.put`` sizes (``"put"``) and the sizes of the results ``group`` gathers from its
    ranks (``"received"``) while the block runs."""
    import ray

    seen: dict[str, list[int]] = {"put": [], "received": []}
    put, gather = ray.put, group._gather

    def counted_put(value, *args, **kwargs):
        seen["put"].append(pickled_bytes(value))
        return put(value, *args, **kwargs)

    def counted_gather(refs, timeout_s):
        results = gather(refs, timeout_s)
        seen["received"].extend(pickled_bytes(r) for r in results)
        return results

    ray.put, group._gather = counted_put, counted_gather
    try:
        yield seen
    finally:
        ray.put = put
        del group._gather


def kept_routes(routes: list[torch.Tensor], num_workers: int) -> tuple[list[Any], list[int], list[Any]]:
    """Routes as the run's engine-facing workers leave them: ``num_workers`` real
    :class:`~megarl.launch.route_workers.RouteWorker` actors (one per engine; no engine is contacted)
    keep sequence ``i``'s routes on worker ``i % num_workers`` (the router spreads trajectories over
    engines) and return parts; one :class:`~megarl.rollout.route_parts.RouteParts` per sequence.

    Returns:
        The entries, the route bytes each worker keeps, and the workers (their objects live as long
        as they do: hold them until the routes are read).
    """
    import ray

    from megarl.launch.route_workers import RouteWorker
    from megarl.rollout.route_parts import RouteParts

    actor: Any = ray.remote(num_cpus=0)(RouteWorker)
    workers = [actor.remote("http://127.0.0.1:9", f"e{j}", 60.0) for j in range(num_workers)]
    parts = ray.get([workers[i % num_workers].keep.remote(r) for i, r in enumerate(routes)])
    kept = [sum(r.nbytes for r in routes[j::num_workers]) for j in range(num_workers)]
    return [RouteParts((p,), p.shape[0]) for p in parts], kept, workers


def step_bytes(group: Any, batch: Any, routes: list[torch.Tensor] | None, *, global_batch_size: int,
               route_workers: int = 0) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run one RL step's trainer calls (`TrainerGroup.prepare`, then `train_step` per mini-batch)
    and count their bytes.

    Args:
        group: a built `megarl.launch.trainer_group.TrainerGroup`.
        batch: the step's `TrainBatch` without ``routed_experts``.
        routes: R3: one ``[L_i, L, K]`` int32 tensor per sequence, put in the object store here
            so the shards carry references; None without R3.
        global_batch_size: ``train.global_batch_size``.
        route_workers: > 0: the routes are kept by that many engine-facing workers
            (:func:`kept_routes`, as in the run); 0: put by this process.

    Returns:
        ``(bytes, metrics)``: ``driver_received`` (total over the step's calls), ``driver_put``
        (the shards), ``rank_received`` (per data-parallel rank: its shard plus its routes),
        ``baseline_driver_received`` and ``baseline_rank_received`` (the old whole-batch path),
        ``rank_route_bytes`` (per data-parallel rank: the routes it fetches), ``route_worker_bytes``
        (per engine-facing worker: the routes it keeps; empty without workers), and the metrics of
        every optimizer step.
    """
    import ray

    from megarl.training.batch import TrainBatch
    from megarl.training.shard import shard_batch

    kept: list[int] = []
    refs: list[Any] | None
    if routes is not None and route_workers > 0:
        refs, kept, workers = kept_routes(routes, route_workers)  # alive until the step ends
    else:
        refs = [ray.put(r) for r in routes] if routes is not None else None
    route_size = {id(ref): r.nbytes for ref, r in zip(refs or [], routes or [])}  # payload: no per-object framing
    shards = shard_batch(batch, dp_size=group.dp_size, cp_size=group.cp_size, global_batch_size=global_batch_size,
                         route_refs=refs)
    with counting(group) as seen:
        group.prepare(shards)
        metrics = [group.train_step(m) for m in range(shards[0].num_minis)]
    rank_routes = [sum(route_size[id(r)] for r in (s.route_refs or [])) for s in shards]
    rank_received = [put + own for put, own in zip(seen["put"], rank_routes)]
    packed = None if routes is None else torch.cat(routes)
    whole: TrainBatch = batch.replace(routed_experts=packed)
    prepared = whole.replace(old_logprobs=torch.zeros(whole.num_tokens))
    route_bytes = 0 if packed is None else packed.nbytes
    return {"driver_received": sum(seen["received"]), "driver_put": sum(seen["put"]),
            "rank_received": rank_received, "baseline_rank_received": pickled_bytes(batch) + route_bytes,
            "baseline_driver_received": group.world_size * pickled_bytes(prepared),
            "rank_route_bytes": rank_routes, "route_worker_bytes": kept}, metrics
