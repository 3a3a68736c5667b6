"""A tied checkpoint (tiny Qwen3-MoE, ``tie_word_embeddings=true``) served by SGLang and trained end to end.

SGLang 0.5.23's Qwen3MoeForCausalLM keeps its own lm_head and never loads it from a tied checkpoint, so
the engine serves an untied view (megarl.rollout.engine_view) and every sync sends the trainer's tied
embedding also as lm_head.weight. References: transformers' forward pass of the tied checkpoint (the
engine at launch), the trainer's own logprobs after two training steps at TP2 (the engine after a sync
by each transport), and a `megarl train` run whose first sync is verified before its first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.testing.multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import workers
from test_weight_sync_engine import TOLERANCE, gap, probes, train_sequences

REPO = Path(__file__).resolve().parents[3]
MEGARL = str(Path(sys.executable).parent / "megarl")


def hf_logprobs(model_dir, sequences) -> list[list[float]]:
    """transformers' teacher-forced logprobs of tokens 1..P-1 (it ties lm_head to the embedding itself)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out.append(logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def _engine(model_dir, tmp_path):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.choice import engine_custom_weight_loaders

    return EngineProcess(model_dir, device="cpu", dtype="float32", mem_fraction_static=0.05, max_total_tokens=8192,
                         grammar_backend="none", env={"OMP_NUM_THREADS": "1"},
                         custom_weight_loaders=engine_custom_weight_loaders("p2p"),
                         log_path=tmp_path / "engine.log", engine_id="tied")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_serves_a_tied_checkpoint_and_every_sync_keeps_its_lm_head_the_embedding(
        tiny_tied_moe_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    engine = _engine(tiny_tied_moe_dir, tmp_path)
    with engine:
        engine.start().wait_healthy(300)
        assert Path(engine.served_path).parent == tmp_path / "cache" / "untied"
        launch_mean, launch_max = gap(workers.engine_logprobs([engine.url], probes())[0],
                                      hf_logprobs(tiny_tied_moe_dir, probes()))
        assert launch_mean < 5e-3, (launch_mean, launch_max)  # sglang_cpu.md: 0.002-0.004 from transformers
        out = run_ranks(workers.train_then_sync, 2, timeout_s=600, args=(
            str(tiny_tied_moe_dir), ["tp2"], ["p2p", "distributed", "disk"], [engine.url], probes(), 1,
            str(tmp_path), train_sequences()))[0]["tp2"]
    report = {}
    for transport, after in out["after"].items():
        before_mean, _ = gap(out["before"][transport][0], out["trainer"])
        mean, peak = gap(after[0], out["trainer"])
        report[transport] = (before_mean, mean, peak)
        assert before_mean > 20 * TOLERANCE, (transport, before_mean)  # training moved the policy
        assert mean <= TOLERANCE, (transport, mean, peak)
        assert out["stale_detected"][transport]
        assert out["metrics"][transport]["weight_sync/hf_bytes"] > 0
    print(f"\ntied tiny Qwen3-MoE: engine at launch vs transformers {launch_mean:.2e} (max {launch_max:.2e}); "
          "after two TP2 training steps, mean|engine - trainer| before -> after sync:")
    for transport, (before, mean, peak) in report.items():
        print(f"  {transport}: {before:.4f} -> {mean:.2e} (max {peak:.2e})")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_engine_serving_the_tied_directory_itself_is_repaired_by_the_first_sync(
        tiny_tied_moe_dir, tmp_path, monkeypatch):
    """What the view prevents, and why an external engine on the tied directory still works: served as it
    is, SGLang samples from an lm_head nothing loaded; the first sync (p2p, checked by megarl's receiver
    against the engine's tensors, lm_head.weight counted) fills it."""
    from megarl.rollout import engine_process as engine_module

    monkeypatch.setattr(engine_module, "served_model_dir", str)  # no view, as an engine megarl did not start
    engine = _engine(tiny_tied_moe_dir, tmp_path)
    with engine:
        engine.start().wait_healthy(300)
        assert engine.served_path == str(tiny_tied_moe_dir)
        launch_mean, _ = gap(workers.engine_logprobs([engine.url], probes())[0],
                             hf_logprobs(tiny_tied_moe_dir, probes()))
        assert not launch_mean < 0.02, launch_mean  # far off (or NaN): the output layer is not the model's (0.14 here)
        out = run_ranks(workers.train_then_sync, 2, timeout_s=600, args=(
            str(tiny_tied_moe_dir), ["tp2"], ["p2p"], [engine.url], probes(), 1, str(tmp_path),
            train_sequences()))[0]["tp2"]
    mean, peak = gap(out["after"]["p2p"][0], out["trainer"])
    assert mean <= TOLERANCE, (mean, peak)
    print(f"\ntied directory served as it is: {launch_mean:.3f} from transformers at launch; "
          f"after a p2p sync {mean:.2e} (max {peak:.2e}) from the trainer")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megarl_train_runs_a_tied_model(tiny_tied_moe_dir, tmp_path):
    """`megarl train` of the CPU recipe on the tied model: validate accepts it, the engine serves the view,
    the first sync (before any rollout) is verified against the trainer, and the first step trains."""
    run_dir = tmp_path / "run"
    overrides = [f"model.hf_path={tiny_tied_moe_dir}", f"logging.run_dir={run_dir}", "train.num_steps=1",
                 "sft.num_steps=0", "data.eval_interval=0", "rollout.num_prompts_per_step=2", "rollout.group_size=4",
                 "train.global_batch_size=8", "algorithm.filter_zero_variance_groups=false",
                 "logging.tensorboard=false", "logging.progress_bar=false", "weight_sync.verify=always",
                 "rollout.engine.startup_timeout_s=600"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", MEGARL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([MEGARL, "train", "configs/cpu_gsm8k.yaml", *overrides], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=840,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss/policy" in r] == [1], rows
    verified = [r["weight_sync/verify_logprob_diff_mean"] for r in rows if "weight_sync/verify_logprob_diff_mean" in r]
    assert verified and max(verified) <= 1e-2, verified
    step = next(r for r in rows if r["step"] == 1)
    assert step["mismatch/log_ratio_abs_mean"] < 1e-3, step  # the rollouts' logprobs are the trainer's
    assert any((tmp_path / "cache" / "untied").iterdir())
    print(f"\nmegarl train, tied tiny Qwen3-MoE: steps {[r['step'] for r in rows]}, verify mean |engine - trainer| "
          f"{verified}, rollout |log ratio| {step['mismatch/log_ratio_abs_mean']:.2e}")
