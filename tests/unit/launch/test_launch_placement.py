"""Rank -> bundle order, node locality of TP groups and colocated engines, thread counts (issue 18
items 8 and 12), on synthetic node / GPU tables of the shape Ray reports."""
import pytest
from omegaconf import OmegaConf

from megarl.cluster import placement as cluster
from megarl.cluster.bundles import devices_per_engine
from megarl.cluster.placement import Placement, bundle_order, check_groups_on_one_node
from megarl.config.schema import MegarlConfig
from megarl.launch.trainer_group import omp_threads

# Ray's PACK over two 4-GPU nodes may hand out bundles interleaved (and GPUs out of order)
NODES = ["A", "B", "A", "B", "B", "A", "A", "B"]
GPUS = ["3", "0", "0", "2", "1", "1", "2", "3"]


def _cfg(**overrides):
    cfg = OmegaConf.structured(MegarlConfig())
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.timeout(30)
def test_bundles_sorted_by_node_then_gpu():
    order = bundle_order(NODES, GPUS)
    assert [(NODES[b], GPUS[b]) for b in order] == [("A", "0"), ("A", "1"), ("A", "2"), ("A", "3"),
                                                   ("B", "0"), ("B", "1"), ("B", "2"), ("B", "3")]
    assert bundle_order(["n1", "n0", "n1"], [None] * 3) == [0, 2, 1]  # CPU: node order, then index


@pytest.mark.timeout(30)
def test_a_tp_group_across_two_nodes_is_refused():
    check_groups_on_one_node([NODES[b] for b in bundle_order(NODES, GPUS)], 4, "parallel.tensor_model_parallel_size")
    with pytest.raises(ValueError, match=r"parallel.tensor_model_parallel_size=2: ranks 0..1 span nodes \['A', 'B'\]"):
        check_groups_on_one_node(NODES, 2, "parallel.tensor_model_parallel_size")  # Ray's raw bundle order


def _ordered(monkeypatch, cfg, *, colocated, num_engines):
    monkeypatch.setattr(cluster, "_bundle_locations", lambda pg, n, cuda: (NODES[:n], GPUS[:n]))
    placement = Placement("pg", "pg" if colocated else "rollout_pg", list(range(num_engines)), 0.5, 0.4, colocated)
    cluster._order_trainer_bundles(placement, cfg, cuda=True, world=8,
                                   per_engine=devices_per_engine(cfg.rollout))
    return placement


@pytest.mark.timeout(30)
def test_trainer_ranks_follow_the_sorted_bundles(monkeypatch):
    placement = _ordered(monkeypatch, _cfg(**{"parallel.tensor_model_parallel_size": 4}), colocated=False,
                         num_engines=2)
    ranks = [(NODES[b], GPUS[b]) for b in placement.trainer_bundles]
    assert ranks == sorted(ranks)
    assert placement.trainer_options(0)["scheduling_strategy"].placement_group_bundle_index == placement.trainer_bundles[0]
    assert placement.engine_bundles == [0, 1] and placement.engine_devices == []  # disaggregated: own bundles


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_colocated_engine_gets_the_gpus_of_its_trainer_ranks(monkeypatch, tp):
    cfg = _cfg(**{"cluster.placement": "colocated", "rollout.engine.tensor_parallel_size": tp,
                  "rollout.num_engines": 8 // tp})
    placement = _ordered(monkeypatch, cfg, colocated=True, num_engines=8 // tp)
    node_gpus = [(NODES[b], GPUS[b]) for b in placement.trainer_bundles]
    for i in range(8 // tp):
        mine = node_gpus[i * tp:(i + 1) * tp]
        assert len({node for node, _ in mine}) == 1  # one node
        assert placement.engine_devices[i] == [gpu for _, gpu in mine]  # TP GPUs, not one
        assert placement.engine_env(i) == {"CUDA_VISIBLE_DEVICES": ",".join(gpu for _, gpu in mine)}
        assert placement.engine_bundles[i] == placement.trainer_bundles[i * tp]  # beside its first rank


@pytest.mark.timeout(30)
def test_colocated_engine_env_is_empty_on_cpu():
    assert Placement("pg", "pg", [0], 0, 0, True).engine_env(0) == {}


@pytest.mark.timeout(30)
def test_omp_threads_share_the_nodes_cores():
    assert omp_threads(128, 8) == 16
    assert omp_threads(6, 8) == 1
    assert omp_threads(16, 3) == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("placement, device, saver", [("colocated", "cuda", True), ("disaggregated", "cuda", False),
                                                      ("colocated", "cpu", False)])
def test_colocated_cuda_engines_start_with_the_memory_saver(placement, device, saver):
    from megarl.cluster.ray_engines import MEMORY_SAVER_FLAG, engine_kwargs

    kwargs = engine_kwargs(_cfg(**{"cluster.placement": placement}), device=device, log_path=None, engine_id="e0")
    assert (MEMORY_SAVER_FLAG in kwargs["extra_args"]) == saver
