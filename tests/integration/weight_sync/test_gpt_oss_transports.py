"""gpt-oss weight sync through every transport megarl offers for it, into a real SGLang CPU server.

SGLang 0.5.23 loads a gpt-oss layer's experts only as whole stacks (``experts.gate_up_proj [E, H, 2F]``,
``down_proj`` and their biases; ``Family.engine_load_groups`` of gpt-oss cites the loader); megarl
plans them per expert and hands each stack over whole (``megarl.weight_sync.stacked_experts``).
References: the trainer's own logprobs after two training steps (engine = trainer within fp32 noise;
SGLang keeps the sinks in bfloat16), and ``disk`` (safetensors + ``/update_weights_from_disk``, SGLang's
own checkpoint loading) for the others.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import gpt_oss_workers
from test_weight_sync_engine import TOLERANCE, gap, probes, train_sequences


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_transport_syncs_gpt_oss_experts_sinks_and_biases(tiny_gpt_oss_dir, tmp_path):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    engine = EngineProcess(tiny_gpt_oss_dir, device="cpu", dtype="float32", mem_fraction_static=0.15,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1"}, log_path=tmp_path / "engine.log", engine_id="gpt_oss_engine")
    engine.start()
    try:
        engine.wait_healthy(300)
        out = run_ranks(gpt_oss_workers.every_transport, 2, timeout_s=1440, args=(
            str(tiny_gpt_oss_dir), [engine.url], probes(), str(tmp_path), train_sequences()))[0]
    finally:
        engine.stop(grace_s=0)
    report = {}
    runs = [(layout, t, o) for layout, o in out["stage"].items() for t in o["after"]]
    runs += [("ep2", "distributed (SGLang's own)", out["unchecked"]["ep2"])]
    for layout, transport, o in runs:
        key = transport.split(" ")[0]
        before, _ = gap(o["before"][key][0], o["trainer"])
        mean, peak = gap(o["after"][key][0], o["trainer"])
        report[(layout, transport)] = (before, mean, peak)
        assert before > 20 * TOLERANCE, (layout, transport, before)  # training moved the policy
        assert mean <= TOLERANCE, (layout, transport, mean, peak)
        assert o["stale_detected"][key] and o["verify"][key]["weight_sync/verify_logprob_diff_mean"] <= TOLERANCE
        if o is out["stage"].get(layout):  # the same trainer's weights loaded by SGLang from safetensors
            assert gap(o["after"][key][0], o["after"]["disk"][0])[1] < 1e-5, (layout, transport)
    owner = out["owner"]
    assert owner["resolved"] == (True, "p2p"), owner["resolved"]
    mean, peak = gap(owner["engine"][0], owner["trainer"])
    assert mean <= TOLERANCE, (mean, peak)
    report[("tp2_ep2_etp1", "p2p, owner senders")] = (float("nan"), mean, peak)
    print("\nlayout transport: mean|engine-trainer| before -> after (max after)")
    for (layout, transport), (before, mean, peak) in report.items():
        print(f"  {layout} {transport}: {before:.4f} -> {mean:.2e} (max {peak:.2e})")
