"""``p2p`` weight sync across hosts: a 2-rank Megatron trainer on one emulated host (its own network
namespace and address) pushes into two SGLang CPU engines of TP=2 on another, shard to shard.

References: the engines' outputs after loading the same trainer weights from disk; the bytes each
engine rank received, counted by the receiver inside the server, over its shard from the plan
(written out for TP=2 in ``test_weight_sync_engine.tp2_rank_shard_bytes``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_weight_sync_engine import gap, tp2_rank_shard_bytes  # noqa: E402

SCRIPT = str(Path(__file__).parent / "p2p_hosts.py")
LAYOUTS = ("tp2", "ep2", "pp2")


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(os.environ.get("MEGARL_P2P_HOSTS_TEST") != "1",
                    reason="opt-in (MEGARL_P2P_HOSTS_TEST=1): not yet seen to pass; its only run here (machine load "
                           "average 100-360) had the trainer host exceed 30 min, cause not diagnosed")
def test_p2p_across_hosts_from_tp2_ep2_pp2_into_two_tp2_engines(tiny_moe_dir, tmp_path):
    from megarl.testing.netns import emulated_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    urls_json, out_json = tmp_path / "urls.json", tmp_path / "out.json"
    with emulated_hosts(["trainer", "rollout"]) as hosts:
        rollout, trainer = hosts["rollout"], hosts["trainer"]
        engines = rollout.popen([sys.executable, SCRIPT, "engines", str(tiny_moe_dir), rollout.addr, "2",
                                 str(urls_json), str(tmp_path)], stdin=subprocess.PIPE)
        deadline = time.monotonic() + 900
        while not urls_json.exists():
            assert engines.poll() is None, f"engines exited: see {tmp_path}/engine*.log"
            assert time.monotonic() < deadline, "engines not healthy within 900 s"
            time.sleep(1)
        urls = json.loads(urls_json.read_text())
        assert all(rollout.addr in u for u in urls)
        try:
            done = trainer.run([sys.executable, SCRIPT, "trainer", str(tiny_moe_dir), trainer.addr, str(urls_json),
                                str(tmp_path / "work"), str(out_json), ",".join(LAYOUTS), "tp2"], timeout=1800)
        finally:
            engines.stdin.close()
            engines.wait(timeout=60)
        assert done.returncode == 0
    results = json.loads(out_json.read_text())
    shard = tp2_rank_shard_bytes(tiny_moe_dir)
    for layout in LAYOUTS:
        out = results[layout]
        assert out["plan_shard_bytes"] == [shard, shard]
        for engine in (0, 1):  # each engine's outputs after the sync == after the disk reload
            assert gap(out["p2p"][engine], out["disk"][engine])[1] < 1e-5, (layout, engine)
        metrics = out["metrics"]["p2p"]
        for rank in (0, 1):  # bytes the receivers counted / shard
            assert metrics[f"weight_sync/engine_rank{rank}_bytes_over_shard"] == pytest.approx(1.0), (layout, metrics)
        assert metrics["weight_sync/bytes_sent"] == 2 * 2 * shard  # 2 engines x 2 ranks, nothing else
    bad = results["tp2"]
    assert "checksum mismatch" in bad["error"] and "bucket 0" in bad["error"] and bad["tensor_names"][0] in bad["error"]
    assert bad["after_corrupt"] == bad["p2p"]  # no engine loaded the corrupted bucket
    print("\ncross-host p2p:", {layout: {k: round(v, 3) for k, v in results[layout]["metrics"]["p2p"].items()
                                         if "over_shard" in k or k == "timing/weight_sync_s"} for layout in LAYOUTS})
