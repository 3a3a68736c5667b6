"""Engines over several nodes placed by Ray (issue 25 part 4), without GPUs: a Ray cluster of
several nodes on this machine (``ray.cluster_utils.Cluster``), each with 2 *logical* GPUs, for
which Ray sets ``CUDA_VISIBLE_DEVICES`` per actor as on real nodes.

The run's own placement (:func:`megarl.cluster.placement.build_placement`) places an engine of TP 4
over nodes of 2 GPUs; the real ``EngineActor`` of each node part (no server started) reports its
Ray node and devices. References: Ray's own answers (the actor's runtime context, the devices Ray
gave it) and the layout: the engine on two distinct whole nodes, none of them the trainer's,
node-rank 0's rendezvous on its own node's address. (Three raylets: Ray gives each 30 s to register,
which a loaded 2-core machine barely meets; the order over several engines is unit-tested in
tests/unit/rollout/test_engine_nodes.py.)
"""
import pytest
import ray

from megarl.cluster.bundles import bundle_shapes
from megarl.cluster.placement import build_placement
from megarl.cluster.ray_engines import engine_kwargs
from megarl.rollout.engine_actor import EngineActor
from megarl.testing.local_ray import private_ray_cluster

ROLLOUT_NODES, GPUS_PER_NODE, TP, ENGINES = 2, 2, 4, 1


def _probed_actor_class():
    """The real actor plus one question: which Ray node is it on (defined here so that Ray ships
    the class by value: workers cannot import a test module)."""

    class ProbedEngineActor(EngineActor):
        def ray_node(self) -> str:
            import ray as ray_

            return ray_.get_runtime_context().get_node_id()

    return ProbedEngineActor


@pytest.fixture(scope="module")
def ray_nodes():
    # role resources as the Slurm job advertises them (slurm/README.md): trainer on the head
    with private_ray_cluster(
            head=dict(num_cpus=2, num_gpus=1, resources={"megarl_trainer": 1}),
            nodes=[dict(num_cpus=2, num_gpus=GPUS_PER_NODE, resources={"megarl_rollout": GPUS_PER_NODE})
                   for _ in range(ROLLOUT_NODES)]) as cluster:
        yield cluster


def _cfg():
    from omegaconf import OmegaConf

    from megarl.config.schema import MegarlConfig

    cfg = OmegaConf.structured(MegarlConfig())
    cfg.cluster.device, cfg.cluster.placement = "cuda", "disaggregated"
    cfg.cluster.trainer_nodes, cfg.cluster.trainer_devices_per_node = 1, 1
    cfg.cluster.rollout_nodes, cfg.cluster.rollout_devices_per_node = ROLLOUT_NODES, GPUS_PER_NODE
    cfg.rollout.engine.tensor_parallel_size, cfg.rollout.num_engines = TP, ENGINES
    return cfg


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_over_two_nodes_takes_whole_distinct_nodes(ray_nodes, tmp_path):
    cfg = _cfg()
    layout = build_placement(cfg, bundle_shapes(cfg), timeout_s=240)
    try:
        head_node = ray.get_runtime_context().get_node_id()
        remote_cls = ray.remote(_probed_actor_class())
        actors = [[remote_cls.options(**layout.engine_options(e, rank)).remote(
            "/m", **engine_kwargs(cfg, device="cuda", log_path=str(tmp_path / f"e{e}n{rank}.log"),
                                  engine_id=f"engine{e}"), nnodes=TP // GPUS_PER_NODE, node_rank=rank)
            for rank in range(TP // GPUS_PER_NODE)] for e in range(ENGINES)]
        nodes = [[ray.get(a.ray_node.remote(), timeout=240) for a in parts] for parts in actors]
        devices = [[ray.get(a.visible_devices.remote(), timeout=60) for a in parts] for parts in actors]
        addrs = [ray.get(parts[0].dist_init_addr.remote(), timeout=60) for parts in actors]
        for e in range(ENGINES):
            assert len(set(nodes[e])) == TP // GPUS_PER_NODE, nodes  # one node per part
            for devs in devices[e]:
                assert devs is not None and len(devs.split(",")) == GPUS_PER_NODE  # the whole node's GPUs
            host, port = addrs[e].rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0  # node-rank 0's own (Ray) address here
        every_part = [n for parts in nodes for n in parts]
        assert len(set(every_part)) == ROLLOUT_NODES and head_node not in every_part
        with pytest.raises(RuntimeError, match="node-rank 0"):
            ray.get(actors[0][1].dist_init_addr.remote(), timeout=60)
        for parts in actors:
            for a in parts:
                ray.kill(a)
    finally:
        layout.remove()
