"""``megarl plan``'s weight-sync seconds are ``megarl plan-sync``'s for the sender path that runs (owner
senders as they run, where they run), at the links of the same ``cluster.gpu`` preset (issue 34 part 1).

References: plan-sync's own blocks computed here (the owner prediction on the owner senders' plan,
the ``[p2p]`` / ``[distributed]`` blocks) and ``link_speeds``, plan-sync's reading of the preset.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import load_config

REPO = Path(__file__).resolve().parents[3]


def _cfg(tiny_moe_dir, *overrides):
    """A DeepSeek-V3-shaped run in small: 4 trainer ranks, TP2, experts over all 4 (one copy), two
    engines of TP2 on other nodes."""
    return load_config(REPO / "configs" / "base.yaml", [
        f"model.hf_path={tiny_moe_dir}", "cluster.device=cpu", "train.precision=fp32", "cluster.gpu=h200",
        "cluster.trainer_devices_per_node=4", "parallel.tensor_model_parallel_size=2",
        "parallel.expert_model_parallel_size=4", "parallel.expert_tensor_parallel_size=1", "rollout.num_engines=2",
        "rollout.engine.tensor_parallel_size=2", "cluster.rollout_nodes=2", "cluster.rollout_devices_per_node=2",
        "weight_sync.bucket_size_mb=1", *overrides])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("senders", ["auto", "segment"])
def test_megarl_plan_sync_seconds_are_plan_syncs_for_the_path_that_runs(tiny_moe_dir, senders):
    from megarl.weight_sync.choice import senders_on_paper
    from megarl.weight_sync.owner_predict import predict_owner_senders
    from megarl.weight_sync.predict import (
        link_speeds,
        placement_from_config,
        plan_from_config,
        predict_from_config,
        sync_seconds,
    )

    cfg = _cfg(tiny_moe_dir, f"weight_sync.senders={senders}")
    intra, inter, source = link_speeds(cfg)
    assert source == "GPU preset h200"
    blocks = {p.transport: p.seconds for p in predict_from_config(cfg, intra_gbps=intra, inter_gbps=inter)[1]}
    owner = predict_owner_senders(plan_from_config(cfg, senders="owner"), placement_from_config(cfg),
                                  inter_gbps=inter).seconds
    seconds = sync_seconds(cfg, intra, inter)
    assert senders_on_paper(cfg) == ("owner" if senders == "auto" else "segment")
    assert seconds == {"p2p": owner if senders == "auto" else blocks["p2p"], "distributed": blocks["distributed"]}
    assert owner != blocks["p2p"]  # the two paths differ here: the test tells them apart


@pytest.mark.timeout(120)
def test_megarl_plan_asks_for_the_sync_at_the_links_plan_sync_reads(tiny_moe_dir, capsys):
    from megarl.config.model_rules import read_hf_config
    from megarl.plan.commands import run_plan
    from megarl.weight_sync.predict import link_speeds, sync_seconds

    cfg = _cfg(tiny_moe_dir)
    asked = []

    def recorded(run_cfg, intra_gbps: float, inter_gbps: float) -> dict:
        asked.append((intra_gbps, inter_gbps))
        return sync_seconds(run_cfg, intra_gbps, inter_gbps)

    args = SimpleNamespace(gpu=None, mfu=0.35, tokens_per_trajectory=None, suggest=False, no_sync=False,
                           config="configs/base.yaml", overrides=[])
    run_plan(args, cfg, read_hf_config(cfg.model.hf_path), recorded, precision="fp32")
    assert asked == [link_speeds(cfg)[:2]]
    seconds = sync_seconds(cfg, *asked[0])
    assert f"weight sync (megarl plan-sync): p2p {seconds['p2p']:.2f} s, distributed {seconds['distributed']:.2f} s" \
        in capsys.readouterr().out
