"""Engine-facing workers for R3: each engine's routes are decoded and kept by its own process.

SGLang returns a generate call's routed experts base64-encoded in the response (~5 GB of int32
per step at the DeepSeek-V3 recipe). Decoded in the rollout actor, every route of the step would
pass through that one process. With ``train.routing_replay: r3`` the rollout actor instead sends
each generate call that asks for routes through the engine's :class:`RouteWorker` (one Ray actor
per engine): it makes the HTTP call, decodes the routes, ``ray.put`` s them (it owns the object)
and returns the output with a :class:`~megarl.rollout.route_parts.RoutePart` (reference and shape)
in their place. The rollout actor stitches parts (:func:`megarl.rollout.route_parts.concat_routes`)
and hands the trainer references only; the rank that trains a sequence fetches its parts
(:func:`megarl.launch.route_files.resolve_routes`). No process on the rollout side holds more than
the calls in flight on its engine; the parts live in the object store of the worker's node.

Every other request (generations without routes, pause, resume, health) goes from the rollout actor
straight to the engine, as before (:class:`RoutedClient` delegates them to its
:class:`~megarl.rollout.client.SGLangClient`).
"""
from __future__ import annotations

import asyncio
from typing import Any

import ray


class RouteWorker:
    """Body of the Ray actor (async) that generates with routes on one engine.

    Args:
        url, engine_id, request_timeout_s: the engine, as for :class:`~megarl.rollout.client.SGLangClient`.
    """

    def __init__(self, url: str, engine_id: str, request_timeout_s: float) -> None:
        from megarl.rollout.client import SGLangClient

        self.client = SGLangClient(url, engine_id=engine_id, request_timeout_s=request_timeout_s)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """:meth:`SGLangClient.generate` with the routes put in the object store (a ``RoutePart``).

        Raises:
            megarl.rollout.client.EngineError: as the client's; a cancelled call aborts the request.
        """
        out = await self.client.generate(input_ids, sampling_params, **kwargs)
        if out.routed_experts is not None:
            out.routed_experts = self.keep(out.routed_experts)
        return out

    def keep(self, routes: Any) -> Any:
        """Put one call's ``[rows, L, K]`` int32 routes in the object store (this worker owns them);
        their :class:`~megarl.rollout.route_parts.RoutePart`."""
        from megarl.rollout.route_parts import RoutePart

        routes = routes.to("cpu").contiguous()
        return RoutePart(ray.put(routes), tuple(routes.shape))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self.client.close()


class RoutedClient:
    """An :class:`~megarl.rollout.client.SGLangClient` whose generate calls asking for routes run in
    the engine's :class:`RouteWorker`; every other call goes to ``client`` itself.

    Args:
        client: the engine's client.
        start_worker: ``() -> actor handle``: starts the engine's worker (again, when it died).
    """

    def __init__(self, client: Any, start_worker: Any) -> None:
        self.client, self.start_worker = client, start_worker
        self.worker = start_worker()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                       return_routed_experts: bool = False, **kwargs: Any) -> Any:
        """As :meth:`SGLangClient.generate`; with routes, through the worker (cancellation reaches it).

        Raises:
            megarl.rollout.client.EngineError: the worker's client raised it (unwrapped from Ray's
                error); ``EngineUnavailableError`` when the worker died (a new one is started, so
                the router's re-sent turn goes through it).
        """
        from megarl.rollout.engine_errors import EngineUnavailableError

        if not return_routed_experts:
            return await self.client.generate(input_ids, sampling_params, **kwargs)
        ref = self.worker.generate.remote(input_ids, sampling_params, return_routed_experts=True, **kwargs)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)  # the worker's coroutine is cancelled: its client aborts the request
            raise
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else None
            if cause is not None:
                raise cause from e
            raise
        except ray.exceptions.RayActorError as e:
            self.worker = self.start_worker()
            raise EngineUnavailableError(f"{self.client.engine_id}: its route worker died ({e}); "
                                         "a new one is started") from e

    async def close(self) -> None:
        """Close both HTTP sessions (the worker's and this one's)."""
        try:
            await self.worker.close.remote()
        except ray.exceptions.RayActorError:
            pass  # the worker is gone already
        finally:
            await self.client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def engine_node(url: str, nodes: list[dict]) -> str | None:
    """The id of the live Ray node whose address is the host of engine ``url`` (``ray.nodes()``
    entries); None when no node has it (an external engine, a host name)."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname
    return next((n["NodeID"] for n in nodes if n.get("Alive") and n.get("NodeManagerAddress") == host), None)


def routed_clients(clients: list[Any], request_timeout_s: float) -> list[RoutedClient]:
    """One :class:`RouteWorker` actor per engine (no CPU reserved; owned by the caller, so they live
    as long as it does), each wrapped with its client. A worker runs on its engine's node when
    that node is in the Ray cluster (:func:`engine_node`; soft affinity), so the routes cross no
    network on the way to it and stay in that node's object store."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote, nodes, out = ray.remote(num_cpus=0)(RouteWorker), ray.nodes(), []
    for c in clients:
        node = engine_node(c.url, nodes)
        options = {} if node is None else {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)}
        out.append(RoutedClient(c, lambda c=c, options=options: remote.options(**options).remote(
            c.url, c.engine_id, request_timeout_s)))
    return out
