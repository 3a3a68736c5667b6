#!/usr/bin/env python3
"""Synchronous vs asynchronous RL on a long-tail agentic task, side by side in one run.

    python tools/benchmarks/async_rl.py [--steps 6] [--staleness 1,2,4] [--drift 4:0.05 ...]
        [--out runs/bench_async]

The same recipe (examples/arithmetic_tool with the slow ``longtail_calculator`` of
tools/benchmarks/async_longtail/task.py: one question in 8 makes its tool wait ``tail_s``) is
trained for ``--steps`` RL steps in sync mode and in async mode at each ``rollout.max_staleness``;
every run trains the same number of trajectories (same prompts per step, same group size).
``--drift K:D`` (repeatable) adds an async run ``async_sK_drift`` at ``rollout.max_staleness=K`` that
also drops trajectories over ``algorithm.max_behaviour_drift=D`` (issue 28). Per run,
over the RL steps after the first (startup, SFT and the first step's cold pipeline excluded):

- ``step_s``: mean wall-clock seconds per RL step (sum of the driver's ``timing/*_s`` stages);
- ``trainer_idle``: the fraction of it the trainer waited for rollouts (``timing/rollout_s``);
- ``ratio``: step_s / sync's step_s (the issue's target: <= 0.6 at staleness 2);
- ``staleness_max`` (trained tokens) and ``dropped_stale``;
- ``dropped_drift``: mean over steps of ``filter/dropped_drift_frac`` (None without a drift bound).

Writes ``summary.json`` and ``summary.md`` into ``--out``; prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples/arithmetic_tool/arithmetic_tool.yaml"
STAGES = ("rollout_s", "advantages_s", "logprobs_s", "train_s", "weight_sync_s")


def overrides(steps: int, model: Path) -> list[str]:
    """The shared recipe: the arithmetic example with the long-tail tool, no evaluation."""
    return [f"train.num_steps={steps}", f"model.hf_path={model}", "plugins=[tools/benchmarks/async_longtail/task.py]",
            "rollout.tools={longtail_calculator: {}}", "rollout.num_prompts_per_step=8", "train.global_batch_size=64",
            "data.eval_interval=0", "data.eval_path=null", "sft.num_steps=150", "logging.progress_bar=false",
            "rollout.agent.tool_timeout_s=60"]


def async_overrides(staleness: int) -> list[str]:
    """Async mode at ``staleness`` with AReaL's decoupled objective."""
    return ["rollout.async_mode=true", f"rollout.max_staleness={staleness}", "algorithm.rollout_correction=decoupled"]


def run(name: str, extra: list[str], steps: int, out: Path, model: Path) -> dict:
    """One training run; its per-step timings from metrics.jsonl."""
    run_dir = out / name
    cmd = [str(Path(sys.executable).parent / "megarl"), "train", str(CONFIG), f"logging.run_dir={run_dir}",
           *overrides(steps, model), *extra]
    start = time.monotonic()
    with open(out / f"{name}.console.log", "wb") as log:
        code = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}); see {out / f'{name}.console.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] >= 2]  # the first step fills the pipeline
    step_s = [sum(r.get(f"timing/{s}", 0.0) for s in STAGES) for r in rows]
    idle = [r.get("timing/rollout_s", 0.0) for r in rows]
    return {"name": name, "step_s": statistics.fmean(step_s), "trainer_idle": sum(idle) / sum(step_s),
            "staleness_max": max(r.get("filter/trained_staleness_max", 0.0) for r in rows),
            "dropped_stale": sum(r.get("filter/dropped_stale", 0.0) for r in rows),
            "trajectories": sum(r.get("filter/kept_trajectories", 0.0) for r in rows),
            "dropped_drift": (statistics.fmean(r["filter/dropped_drift_frac"] for r in rows)
                              if all("filter/dropped_drift_frac" in r for r in rows) else None),
            "wall_s": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", default="1,2,4")
    parser.add_argument("--out", type=Path, default=REPO / "runs/bench_async")
    parser.add_argument("--drift", action="append", default=[], metavar="K:D",
                        help="add an async run at max_staleness K with max_behaviour_drift D (repeatable)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    if not (model / "config.json").is_file():
        subprocess.check_call([sys.executable, str(REPO / "examples/arithmetic_tool/make_model.py"), str(model)],
                              cwd=REPO)
    results = [run("sync", [], args.steps, args.out, model)]
    for k in (int(s) for s in args.staleness.split(",")):
        results.append(run(f"async_s{k}", async_overrides(k), args.steps, args.out, model))
    for spec in args.drift:
        k, bound = spec.split(":")
        drift = [*async_overrides(int(k)), f"algorithm.max_behaviour_drift={bound}"]
        results.append(run(f"async_s{int(k)}_drift", drift, args.steps, args.out, model))
    base = results[0]["step_s"]
    lines = ["| run | s/step | ratio vs sync | trainer idle | staleness max | dropped stale | trained trajectories | "
             "dropped drift |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        r["ratio"] = r["step_s"] / base
        lines.append(f"| {r['name']} | {r['step_s']:.1f} | {r['ratio']:.2f} | {r['trainer_idle']:.0%} | "
                     f"{r['staleness_max']:.0f} | {r['dropped_stale']:.0f} | {r['trajectories']:.0f} | "
                     f"{'-' if r['dropped_drift'] is None else format(r['dropped_drift'], '.1%')} |")
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
