"""``megarl plan-sync`` for an engine over several nodes (issue 25 part 4): each engine rank is put on
the node SGLang runs it on (``entrypoints/engine._calculate_rank_ranges``: node r of N runs TP ranks
``r*tp/N .. (r+1)*tp/N - 1``), and each engine node's bytes are the sum of its ranks' bytes."""
from pathlib import Path

from megarl.config import load_config
from megarl.weight_sync.predict import format_prediction, predict_from_config

REPO = Path(__file__).resolve().parents[3]


def _predict(tiny_moe_dir, *overrides):
    cfg = load_config(REPO / "configs" / "base.yaml", [f"model.hf_path={tiny_moe_dir}", "cluster.device=cpu",
                                                       "train.precision=fp32", *overrides])
    return predict_from_config(cfg, intra_gbps=200, inter_gbps=50)


def test_engine_ranks_are_placed_on_the_nodes_sglang_runs_them_on(tiny_moe_dir):
    plan, preds = _predict(tiny_moe_dir, "rollout.engine.tensor_parallel_size=4", "cluster.rollout_devices_per_node=2",
                           "cluster.rollout_nodes=2")
    for p in preds:
        assert p.engine_rank_node == [0, 0, 1, 1]
    text = format_prediction(plan, preds, intra_gbps=200, inter_gbps=50)
    assert "each engine spans 2 nodes" in text
    p2p = preds[0]
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        line = next(x for x in text.splitlines() if x.strip().startswith(f"node {node}:"))
        assert f"ranks {ranks[0]}-{ranks[-1]}, {sum(p2p.engine_rank_bytes[r] for r in ranks) / 1e9:.2f} GB" in line


def test_engine_on_one_node_reports_no_engine_nodes(tiny_moe_dir):
    plan, preds = _predict(tiny_moe_dir, "rollout.engine.tensor_parallel_size=2", "cluster.rollout_devices_per_node=2")
    assert all(p.engine_rank_node == [0, 0] for p in preds)
    assert "spans" not in format_prediction(plan, preds, intra_gbps=200, inter_gbps=50)
