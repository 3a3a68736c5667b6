#!/usr/bin/env python3
"""The CPU learning demonstration: SFT cold start, then GSPO, for several seeds; held-out reward before/after.

    python examples/arithmetic_tool/run_demo.py [--seeds 1 2 3] [--out runs/arithmetic_demo] [override ...]

Each seed is one ``megarl train examples/arithmetic_tool/arithmetic_tool.yaml train.seed=S`` run: the
held-out evaluation (greedy, ``data.eval_path``) is logged at step 0 (after the SFT cold start,
before any GSPO step) and after the last step. Writes ``summary.json`` and ``summary.md`` (per seed
and mean +- std) into ``--out`` and prints the table. Exit status 1 when a run fails.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "arithmetic_tool.yaml"
REPO = Path(__file__).resolve().parents[2]
KEYS = ("eval/accuracy", "eval/tool_calls_mean")


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """Train one seed; its eval metrics before (step 0) and after (last step), and its wall time."""
    run_dir = out / f"seed{seed}"
    start = time.monotonic()
    cmd = [str(Path(sys.executable).parent / "megarl"), "train", str(CONFIG), f"train.seed={seed}",
           f"logging.run_dir={run_dir}", "logging.progress_bar=false", *overrides]
    with open(out / f"seed{seed}.console.log", "wb") as log:
        code = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"seed {seed} failed (exit {code}); see {out / f'seed{seed}.console.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {"seed": seed, "before": {k: evals[0][k] for k in KEYS}, "after": {k: evals[-1][k] for k in KEYS},
            "steps": int(evals[-1]["step"]), "wall_s": time.monotonic() - start}


def summarize(results: list[dict]) -> dict:
    """Mean and (population) std over seeds of every before/after metric."""
    out = {}
    for when in ("before", "after"):
        for key in KEYS:
            values = [r[when][key] for r in results]
            out[f"{when}/{key}"] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
    return out


def table(results: list[dict], summary: dict) -> str:
    lines = ["| seed | accuracy before | accuracy after | tool calls before | tool calls after | wall |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['before']['eval/accuracy']:.3f} | {r['after']['eval/accuracy']:.3f} | "
                     f"{r['before']['eval/tool_calls_mean']:.2f} | {r['after']['eval/tool_calls_mean']:.2f} | "
                     f"{r['wall_s'] / 60:.1f} min |")
    b, a = summary["before/eval/accuracy"], summary["after/eval/accuracy"]
    lines.append(f"| mean +- std | {b['mean']:.3f} +- {b['std']:.3f} | {a['mean']:.3f} +- {a['std']:.3f} | | | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="runs/arithmetic_demo")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_seed(seed, out, args.overrides) for seed in args.seeds]
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    text = table(results, summary)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
