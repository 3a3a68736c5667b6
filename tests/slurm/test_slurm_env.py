"""megarl.cluster.slurm_env without Slurm: allocation parsing, checks and the Ray resource plan."""
import pytest

from megarl.cluster.slurm_env import (
    Allocation,
    NodePlan,
    allocation_issues,
    expand_counts,
    missing_nodes,
    plan_nodes,
    read_plan,
)
from megarl.config import load_config

pytestmark = pytest.mark.slurm


def _cfg(*overrides):
    return load_config(None, ["cluster.device=cpu", *overrides])


def test_expand_counts_matches_slurm_syntax():
    assert expand_counts("4(x2),8") == [4, 4, 8]
    assert expand_counts("72") == [72]
    with pytest.raises(ValueError, match="per-node count"):
        expand_counts("4(2)")


def test_allocation_from_env_per_node_lists_and_errors():
    a = Allocation.from_env({"MEGARL_ALLOC_NODES": "3", "MEGARL_ALLOC_HOSTS": "a b c",
                             "MEGARL_ALLOC_NODE_CPUS": "4(x2),8", "MEGARL_ALLOC_GPUS_PER_NODE": "8"})
    assert a.hosts == ("a", "b", "c") and a.cpus == (4, 4, 8) and a.gpus == (8, 8, 8) and a.het_groups is None
    with pytest.raises(ValueError, match="MEGARL_ALLOC_NODE_CPUS"):
        Allocation.from_env({"MEGARL_ALLOC_NODES": "3", "MEGARL_ALLOC_NODE_CPUS": "4,4"})
    with pytest.raises(ValueError, match="MEGARL_ALLOC_NODES"):
        Allocation.from_env({})


def test_plan_disaggregated_follows_the_resource_convention():
    cfg = _cfg("cluster.trainer_nodes=2", "cluster.trainer_devices_per_node=8", "cluster.rollout_nodes=1",
               "cluster.rollout_devices_per_node=4")
    plans = plan_nodes(cfg, Allocation(("n0", "n1", "n2", "n3"), (64,) * 4, (0,) * 4))
    assert [p.role for p in plans] == ["trainer", "trainer", "rollout", "unused"]
    assert plans[0].resources == {"megarl_node_0": 1, "megarl_head": 1, "megarl_trainer": 8}
    assert plans[1].resources == {"megarl_node_1": 1, "megarl_trainer": 8}
    assert plans[2].resources == {"megarl_node_2": 1, "megarl_rollout": 4}
    assert plans[3].resources == {"megarl_node_3": 1}
    assert all(p.num_gpus == 0 and p.num_cpus == 64 for p in plans)  # CPU run: Ray must not look for GPUs


def test_plan_colocated_external_and_gpu():
    cfg = _cfg("cluster.device=cuda", "cluster.placement=colocated", "cluster.trainer_nodes=2",
               "cluster.rollout_nodes=2")
    plans = plan_nodes(cfg, Allocation(("n0", "n1"), (0, 0), (8, 8)))
    assert [p.role for p in plans] == ["trainer+rollout"] * 2
    assert all(p.num_gpus == -1 for p in plans)  # CUDA: Ray detects the GPUs
    ext = _cfg("cluster.rollout_nodes=3", "rollout.external_engine_urls=[http://h:30000]")
    assert [p.role for p in plan_nodes(ext, Allocation(("n0",), (1,), (0,)))] == ["trainer"]
    assert allocation_issues(ext, Allocation(("n0",), (1,), (0,))) == []


def test_plan_line_round_trips(tmp_path):
    plans = plan_nodes(_cfg(), Allocation(("n0", "n1"), (2, 2), (0, 0)))
    (tmp_path / "plan.txt").write_text("".join(p.line() + "\n" for p in plans))
    assert read_plan(str(tmp_path / "plan.txt")) == plans


def test_hetjob_components_are_checked_per_side():
    cfg = _cfg("cluster.device=cuda", "cluster.trainer_nodes=2", "cluster.trainer_devices_per_node=8",
               "cluster.rollout_nodes=2", "cluster.rollout_devices_per_node=4")
    alloc = Allocation(("t0", "t1", "t2", "r0"), (0,) * 4, (8, 8, 8, 2), het_groups=(0, 0, 0, 1))
    plans = plan_nodes(cfg, alloc)
    assert [p.role for p in plans] == ["trainer", "trainer", "unused", "rollout"]
    issues = {i.key: i.message for i in allocation_issues(cfg, alloc)}
    assert set(issues) == {"cluster.rollout_nodes", "cluster.rollout_devices_per_node"}
    assert "het-job component 1" in issues["cluster.rollout_nodes"]
    assert "r0:2" in issues["cluster.rollout_devices_per_node"]


def test_cuda_config_on_gpu_less_allocation_is_refused():
    issues = allocation_issues(_cfg("cluster.device=cuda"), Allocation(("n0", "n1"), (4, 4), (0, 0)))
    assert [i.key for i in issues] == ["cluster.trainer_devices_per_node", "cluster.rollout_devices_per_node"]


def test_missing_nodes_matches_by_node_resource():
    plans = [NodePlan(0, "a", 0, "trainer", 1, 0, {}), NodePlan(1, "b", 0, "rollout", 1, 0, {})]
    nodes = [{"Alive": True, "Resources": {"megarl_node_0": 1.0, "CPU": 1.0}},
             {"Alive": False, "Resources": {"megarl_node_1": 1.0}}]
    assert [p.host for p in missing_nodes(nodes, plans)] == ["b"]
    nodes[1]["Alive"] = True
    assert missing_nodes(nodes, plans) == []
