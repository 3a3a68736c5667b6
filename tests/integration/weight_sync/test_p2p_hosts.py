"""``p2p`` weight sync across hosts: a 2-rank Megatron trainer on one emulated host (its own network
namespace and address) pushes into two SGLang CPU engines of TP=2 on another, shard to shard; at
DP2 (two complete copies of the model) each trainer rank sends to one engine, side by side.

References: the engines' outputs after loading the same trainer weights from disk; the bytes each
engine rank received, counted by the receiver inside the server, over its shard from the plan
(written out for TP=2 in ``test_weight_sync_engine.tp2_rank_shard_bytes``).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_weight_sync_engine import gap, tp2_rank_shard_bytes

SCRIPT = str(Path(__file__).parent / "p2p_hosts.py")
LAYOUTS = ("tp2", "ep2", "pp2", "dp2")
SENDERS = {"tp2": 1, "ep2": 1, "pp2": 1, "dp2": 2}
"""Senders per stage: DP2 holds two complete copies of the model, one per engine."""

# Time limits, innermost first; each outer one exceeds what it waits for, so the innermost that
# trips reports (with the logs below) instead of pytest killing everything silently.
ENGINES_HEALTHY_S = 480
"""Both engines healthy (the engines script's one deadline); the test waits this plus 60 s."""
TRAINER_RANKS_S = 480
"""The two trainer ranks, all layouts (``run_ranks`` inside the trainer script)."""
TRAINER_S = TRAINER_RANKS_S + 300
"""The trainer script: imports, the ranks, writing the results."""
TEARDOWN_S = 180
"""Closing the engines (60 s) and deleting the namespaces."""
TEST_TIMEOUT_S = ENGINES_HEALTHY_S + 60 + TRAINER_S + TEARDOWN_S + 120
"""pytest's limit: everything above plus a margin (1620 s; the whole test took 80 s at load average 38)."""
LOG_TAIL_LINES = 200


def print_logs(directory: Path) -> None:
    """The last lines of every log under ``directory`` (trainer script, trainer ranks with their
    stack dumps, engines), for a failed run."""
    for log in sorted(directory.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"\n===== {log.relative_to(directory)} (last {min(len(lines), LOG_TAIL_LINES)} of {len(lines)} lines)")
        print("\n".join(lines[-LOG_TAIL_LINES:]))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_p2p_across_hosts_from_tp2_ep2_pp2_dp2_into_two_tp2_engines(tiny_moe_dir, tmp_path):
    from megarl.testing.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        _run_across_hosts(tiny_moe_dir, tmp_path)
        _check_results(tiny_moe_dir, tmp_path)
    except BaseException:  # a failure, a timeout or pytest's own: show what every process wrote
        print_logs(tmp_path)
        raise


def _run_across_hosts(tiny_moe_dir, tmp_path: Path) -> None:
    """Engines on one emulated host, the trainer on another; the trainer writes ``out.json``."""
    from megarl.testing.netns import emulated_hosts

    urls_json, out_json = tmp_path / "urls.json", tmp_path / "out.json"
    with emulated_hosts(["trainer", "rollout"]) as hosts:
        rollout, trainer = hosts["rollout"], hosts["trainer"]
        engines = rollout.popen([sys.executable, SCRIPT, "engines", str(tiny_moe_dir), rollout.addr, "2",
                                 str(urls_json), str(tmp_path), str(ENGINES_HEALTHY_S)], stdin=subprocess.PIPE)
        deadline = time.monotonic() + ENGINES_HEALTHY_S + 60
        while not urls_json.exists():
            assert engines.poll() is None, f"engines exited with {engines.returncode}: see the engine logs"
            assert time.monotonic() < deadline, f"engines not healthy within {ENGINES_HEALTHY_S} s"
            time.sleep(1)
        urls = json.loads(urls_json.read_text())
        assert all(rollout.addr in u for u in urls)
        try:
            with open(tmp_path / "trainer.log", "w") as log:
                done = trainer.run([sys.executable, SCRIPT, "trainer", str(tiny_moe_dir), trainer.addr,
                                    str(urls_json), str(tmp_path / "work"), str(out_json), str(TRAINER_RANKS_S),
                                    ",".join(LAYOUTS), "tp2"],
                                   stdout=log, stderr=subprocess.STDOUT, timeout=TRAINER_S)
        finally:
            engines.stdin.close()
            engines.wait(timeout=60)
        assert done.returncode == 0, f"trainer script exited with {done.returncode}"


def _check_results(tiny_moe_dir, tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
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
        assert metrics["weight_sync/senders_per_stage"] == SENDERS[layout]
    bad = results["tp2"]
    assert "checksum mismatch" in bad["error"] and "bucket 0" in bad["error"] and bad["tensor_names"][0] in bad["error"]
    assert bad["after_corrupt"] == bad["p2p"]  # no engine loaded the corrupted bucket
    print("\ncross-host p2p:", {layout: {k: round(v, 3) for k, v in results[layout]["metrics"]["p2p"].items()
                                         if "over_shard" in k or k == "timing/weight_sync_s"} for layout in LAYOUTS})
