"""An async checkpoint writes the in-flight rollouts' R3 routes without gathering them in the driver
(issue 35 item 2): one Ray task per group fetches the rollout side's references and writes a file;
the driver state holds only (path, index) entries, which a trainer rank resolves like a reference.

References: the routes regenerated from the same seed (an independent copy, not the object-store
one), the pickled sizes of what the driver's ``ray.get`` returns and of the saved state (what
``torch.save`` writes), and the files on disk.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

LAYERS, TOPK, EXPERTS = 4, 4, 64
GROUPS, PER_GROUP = 6, 4


def _routes(group: int, layers: int = LAYERS, topk: int = TOPK, experts: int = EXPERTS,
            per_group: int = PER_GROUP) -> list[torch.Tensor]:
    import torch  # self-contained: the rollout actor below runs it (by value) on a Ray worker

    gen = torch.Generator().manual_seed(group)
    return [torch.randint(0, experts, (int(n), layers, topk), generator=gen, dtype=torch.int32)
            for n in torch.randint(2000, 4000, (per_group,), generator=gen)]


def _groups_with_references():
    """The rollout side as the run has it: an actor builds the groups and puts their routes
    (`put_routes`, the rollout actor's own function), so it owns the objects; the driver gets references."""
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    make_routes = _routes

    @ray.remote(num_cpus=0)
    class Rollout:
        def generate(self, num_groups):
            import torch

            from megarl.launch.rollout_actor import put_routes
            from megarl.rollout.types import Trajectory, TrajectoryGroup

            groups = []
            for g in range(num_groups):
                trajs = [Trajectory(prompt_ids=torch.ones(2, dtype=torch.int64),
                                    response_ids=torch.ones(len(r) - 2, dtype=torch.int64),
                                    loss_mask=torch.ones(len(r) - 2), rollout_logprobs=torch.zeros(len(r) - 2),
                                    routed_experts=r, group_id=g) for r in make_routes(g)]
                groups.append(TrajectoryGroup(group_id=g, trajectories=trajs))
            put_routes(groups)
            return groups

    owner = Rollout.remote()
    return owner, ray.get(owner.generate.remote(GROUPS))


@pytest.fixture
def local_ray():
    import ray

    from megarl.testing.local_ray import private_ray

    with private_ray(num_cpus=2, log_to_driver=False):
        yield ray


@pytest.mark.slow  # a private Ray instance: ~40 s on the shared 2-core machine
@pytest.mark.timeout(240)
def test_checkpoint_writes_routes_per_group_without_the_driver(local_ray, tmp_path, monkeypatch):
    from megarl.launch.route_files import ROUTES_DIR, RouteFile, resolve_routes, write_routes

    ray = local_ray
    owner, groups = _groups_with_references()
    assert all(isinstance(t.routed_experts, ray.ObjectRef) for g in groups for t in g.trajectories)
    expected = [_routes(g) for g in range(GROUPS)]
    route_bytes = sum(r.nbytes for rs in expected for r in rs)
    received = []
    get = ray.get
    monkeypatch.setattr(ray, "get", lambda refs, **kw: received.append(pickle.dumps(out := get(refs, **kw))) or out)
    saved = write_routes(groups, tmp_path / "step_1", "p0")
    monkeypatch.setattr(ray, "get", get)
    # the driver fetched task results only: a few bytes per group, not the routes (~4.8 MB here)
    assert route_bytes > 4e6 and sum(len(b) for b in received) < 200 * GROUPS, [len(b) for b in received]
    state = pickle.dumps(saved)  # what the driver state holds: the trajectories, and a path per route
    without = copy.deepcopy(saved)
    for traj in (t for g in without for t in g.trajectories):
        traj.routed_experts = None
    assert len(state) < len(pickle.dumps(without)) + 200 * GROUPS * PER_GROUP
    files = sorted((tmp_path / "step_1" / ROUTES_DIR).glob("*.pt"))
    assert len(files) == GROUPS  # one file, one writer, per group
    for g, group in enumerate(pickle.loads(state)):
        entries = [t.routed_experts for t in group.trajectories]
        assert all(isinstance(e, RouteFile) for e in entries)
        for got, ref in zip(resolve_routes(entries), expected[g]):
            assert torch.equal(got, ref)
    assert all(isinstance(t.routed_experts, ray.ObjectRef) for g in groups for t in g.trajectories)  # unchanged

    # a resumed run saves its still-pending rollouts again: files are rewritten into the new
    # checkpoint, and the in-memory entries follow them (rotation deletes the old checkpoint)
    resumed = pickle.loads(state)
    again = write_routes(resumed, tmp_path / "step_2", "p0")
    for path in (tmp_path / "step_1" / ROUTES_DIR).glob("*.pt"):
        path.unlink()
    for g in range(GROUPS):
        for copy_ in (again[g], resumed[g]):
            entries = [t.routed_experts for t in copy_.trajectories]
            assert all("step_2" in e.path for e in entries)
            assert all(torch.equal(a, b) for a, b in zip(resolve_routes(entries), expected[g]))
    ray.kill(owner)
