"""GPU placement without GPUs (issue 18): a Ray node started with 8 *logical* GPUs makes Ray set
``CUDA_VISIBLE_DEVICES`` for every actor exactly as on a real node. The run's own placement
(:func:`megarl.cluster.placement.build_placement`) places the real actor classes (``TrainerWorker``,
``EngineActor``; neither builds a model or starts a server here), and each reports what it sees.

Asserted, for disaggregated and colocated placement and engine TP 1, 2 and 4:
- every trainer rank sees one GPU and selects device 0 (``set_device(LOCAL_RANK)`` would fail);
- disaggregated: each engine's server sees its TP GPUs, disjoint from the trainer's and the others';
- colocated: engine ``i``'s server sees the GPUs of trainer ranks ``i*tp .. (i+1)*tp-1`` and starts
  with ``--enable-memory-saver``.
"""
import pytest
import ray
from omegaconf import OmegaConf

from megarl.cluster.bundles import bundle_shapes, devices_per_engine
from megarl.cluster.placement import build_placement
from megarl.cluster.ray_engines import MEMORY_SAVER_FLAG, engine_kwargs
from megarl.config.schema import MegarlConfig
from megarl.launch.trainer_group import TrainerWorker
from megarl.rollout.engine_actor import EngineActor
from megarl.testing.local_ray import private_ray

NUM_GPUS = 8


@pytest.fixture(scope="module")
def logical_gpu_ray():
    with private_ray(num_cpus=16, num_gpus=NUM_GPUS):
        yield


def _cfg(placement, tp, ranks):
    cfg = OmegaConf.structured(MegarlConfig())
    cfg.cluster.device, cfg.cluster.placement = "cuda", placement
    cfg.cluster.trainer_devices_per_node = ranks
    cfg.cluster.rollout_devices_per_node = ranks  # one host: each engine on one node (a larger one spans nodes)
    cfg.rollout.engine.tensor_parallel_size = tp
    cfg.rollout.num_engines = ranks // tp
    return cfg


@pytest.mark.slow
@pytest.mark.ci  # ~30 s
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_devices_each_trainer_rank_and_engine_sees(logical_gpu_ray, tmp_path, placement, tp):
    ranks = max(tp, 2)  # few actors: each one is a new worker process
    cfg = _cfg(placement, tp, ranks)
    assert devices_per_engine(cfg.rollout) == tp
    layout = build_placement(cfg, bundle_shapes(cfg), timeout_s=60)
    assert layout.cuda and layout.engine_nodes == 1  # what EngineGroup and TrainerGroup read off it
    actors = []
    try:
        trainers = [TrainerWorker.options(**layout.trainer_options(r)).remote(r, ranks, {})
                    for r in range(ranks)]
        actors += trainers
        engine_cls, engines, saver = ray.remote(EngineActor), [], []
        for i in range(cfg.rollout.num_engines):
            kwargs = engine_kwargs(cfg, device="cuda", log_path=None, engine_id=f"engine{i}",
                                   env=layout.engine_env(i))  # as EngineGroup does
            saver.append(MEMORY_SAVER_FLAG in kwargs["extra_args"])
            engines.append(engine_cls.options(**layout.engine_options(i)).remote(str(tmp_path), **kwargs))
        actors += engines
        seen = ray.get([t.device_info.remote() for t in trainers], timeout=180)
        servers = [v.split(",") for v in ray.get([e.visible_devices.remote() for e in engines], timeout=180)]
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        layout.remove()
    for info in seen:
        assert info["gpu_ids"] == [info["visible"]] and info["device_index"] == 0
    trainer_gpus = [info["visible"] for info in seen]
    assert len(set(trainer_gpus)) == ranks
    assert all(len(gpus) == tp for gpus in servers)
    if placement == "disaggregated":
        used = [g for gpus in servers for g in gpus]
        assert len(set(used)) == len(used) == ranks and not set(used) & set(trainer_gpus)
        assert saver == [False] * len(engines)
    else:
        assert servers == [trainer_gpus[i * tp:(i + 1) * tp] for i in range(len(engines))]
        assert saver == [True] * len(engines)
