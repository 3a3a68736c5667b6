"""megarl validate: an engine larger than a node spans whole nodes (issue 25 part 4).

The rule comes from SGLang 0.5.23 (``arg_groups/validation_hook.check_server_args``: the TP size is
divided evenly over ``--nnodes``; ``entrypoints/engine._calculate_rank_ranges``: node ``r`` runs TP
ranks ``r * tp/nnodes ...``) and from whole-node placement: every node part owns all the devices of
its node, so ``tp`` must be a multiple of ``cluster.rollout_devices_per_node``.
"""
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[3]


def _issues(overrides) -> dict[str, str]:
    try:
        validate(load_config(REPO / "configs" / "base.yaml", overrides))
    except ConfigError as err:
        return {issue.key: str(issue) for issue in err.issues}
    return {}


@pytest.mark.parametrize("tp,per_node,nodes,engines", [(2, 1, 2, 1), (4, 2, 2, 1), (4, 1, 8, 2), (4, 2, 4, 2)])
def test_engine_over_whole_nodes_is_accepted(good_overrides, tp, per_node, nodes, engines):
    assert _issues(good_overrides + [f"rollout.engine.tensor_parallel_size={tp}", f"cluster.rollout_devices_per_node={per_node}",
                           f"cluster.rollout_nodes={nodes}", f"rollout.num_engines={engines}"]) == {}


def test_engine_over_a_partial_node_is_refused_naming_the_keys(good_overrides):
    issues = _issues(good_overrides + ["rollout.engine.tensor_parallel_size=4", "cluster.rollout_devices_per_node=3",
                             "cluster.rollout_nodes=2"])
    msg = issues["rollout.engine.tensor_parallel_size"]
    assert "partial node" in msg and "cluster.rollout_devices_per_node=3" in msg


def test_spanning_engines_need_their_nodes(good_overrides):
    # 2 engines x 2 nodes each = 4 nodes > 3
    issues = _issues(good_overrides + ["rollout.engine.tensor_parallel_size=4", "cluster.rollout_devices_per_node=2",
                             "cluster.rollout_nodes=3", "rollout.num_engines=2"])
    assert set(issues) == {"rollout.num_engines"}
    assert "4 nodes" in issues["rollout.num_engines"] and "cluster.rollout_nodes=3" in issues["rollout.num_engines"]


def test_colocated_engine_still_runs_on_one_node(good_overrides):
    issues = _issues(good_overrides + ["cluster.placement=colocated", "rollout.engine.tensor_parallel_size=4",
                             "cluster.trainer_devices_per_node=2", "weight_sync.transport=tensor"])
    assert "cluster.placement=disaggregated" in issues["rollout.engine.tensor_parallel_size"]
