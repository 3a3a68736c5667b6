"""R3 routes are decoded and kept by the engine-facing worker, not by the rollout actor (issue 35
item 2): a generate call that asks for routes goes through the engine's ``RouteWorker`` (a Ray
actor), which returns a part (reference + shape); the trainer-side resolution assembles the tensor.

References: the same greedy call through a plain ``SGLangClient`` on the same real SGLang CPU
server (its decoded tensor), and the pickled size of what the caller receives.
"""
from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the shared engine's start, a private Ray


@pytest.fixture
def local_ray():
    import ray

    from megarl.testing.local_ray import private_ray

    with private_ray(num_cpus=2, log_to_driver=False):
        yield ray


async def test_routes_are_kept_by_the_engine_facing_worker(sglang_url, local_ray):
    from megarl.launch.route_files import resolve_routes
    from megarl.launch.route_workers import engine_node, routed_clients
    from megarl.rollout.client import SGLangClient
    from megarl.rollout.route_parts import RoutePart, RouteParts

    prompt = list(range(5, 69))
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    async with SGLangClient(sglang_url) as plain:
        reference = await plain.generate(prompt, params, return_routed_experts=True)
    # the worker goes to the engine's node: here the one node of the local Ray, at the engine's address
    assert engine_node(sglang_url, local_ray.nodes()) == local_ray.get_runtime_context().get_node_id()
    assert engine_node("http://10.255.255.1:30000", local_ray.nodes()) is None  # not in the cluster
    routed = routed_clients([SGLangClient(sglang_url, engine_id="e0")], 120.0)[0]
    try:
        out = await routed.generate(prompt, params, return_routed_experts=True)
        assert out.output_ids == reference.output_ids
        part = out.routed_experts
        assert isinstance(part, RoutePart) and part.shape == tuple(reference.routed_experts.shape)
        # what the rollout actor holds: the output without the routes' bytes
        held = len(pickle.dumps(out))
        out.routed_experts = None
        assert held < len(pickle.dumps(out)) + 300 < reference.routed_experts.nbytes
        rows = len(prompt) + len(out.output_ids)  # the trajectory's positions: the last one never read
        (whole,) = resolve_routes([RouteParts((part,), rows)])
        assert torch.equal(whole[:-1], reference.routed_experts) and whole[-1].eq(-1).all()
        # a call without routes goes straight to the engine, as before
        assert (await routed.generate(prompt, params)).routed_experts is None
        # a worker that died: the turn fails as an unavailable engine (the router re-sends it) and
        # the next one goes through a new worker
        from megarl.rollout.engine_errors import EngineUnavailableError

        dead = routed.worker
        local_ray.kill(dead)
        with pytest.raises(EngineUnavailableError, match="route worker died"):
            await routed.generate(prompt, params, return_routed_experts=True)
        again = await routed.generate(prompt, params, return_routed_experts=True)
        assert routed.worker is not dead and again.routed_experts.shape == part.shape
    finally:
        await routed.close()
