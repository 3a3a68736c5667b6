#!/usr/bin/env python3
"""The CPU learning demonstration: SFT cold start, then GSPO, for several seeds; held-out reward before/after.

    python examples/arithmetic_tool/run_demo.py [--seeds 1,2,3] [--out runs/arithmetic_demo]
        [--chat-template tiny|qwen3] [override ...]

``--chat-template qwen3`` builds the model on the official Qwen3 template and runs with thinking off
(``rollout.agent.chat_template_kwargs.enable_thinking=false``: every prompt, observation suffix and
SFT demonstration gets Qwen3's empty think block) and a longer SFT cold start (600 steps).

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
KEYS = ("eval/accuracy", "eval/sampled_reward_mean", "eval/tool_calls_mean")


def run_seed(seed: int, out: Path, overrides: list[str], *, config: Path = CONFIG) -> dict:
    """Train one seed of ``config``; its eval metrics before (step 0) and after (last step), and
    its wall time (examples/search_r1/run_demo.py runs its own recipe through this too)."""
    run_dir = out / f"seed{seed}"
    start = time.monotonic()
    cmd = [str(Path(sys.executable).parent / "megarl"), "train", str(config), f"train.seed={seed}",
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
    """Markdown: per seed and mean +- std, held-out reward before (after SFT) and after GSPO."""
    cols = (("eval/sampled_reward_mean", "sampled reward (mean@4)", "{:.3f}"),
            ("eval/accuracy", "greedy accuracy", "{:.3f}"), ("eval/tool_calls_mean", "tool calls", "{:.2f}"))
    head = " | ".join(f"{name} before | {name} after" for _, name, _ in cols)
    lines = [f"| seed | {head} | wall |", "|---" * (2 + 2 * len(cols)) + "|"]
    for r in results:
        cells = " | ".join(f"{fmt.format(r['before'][k])} | {fmt.format(r['after'][k])}" for k, _, fmt in cols)
        lines.append(f"| {r['seed']} | {cells} | {r['wall_s'] / 60:.1f} min |")
    cells = " | ".join(f"{summary[f'before/{k}']['mean']:.3f} +- {summary[f'before/{k}']['std']:.3f} | "
                       f"{summary[f'after/{k}']['mean']:.3f} +- {summary[f'after/{k}']['std']:.3f}" for k, _, _ in cols)
    lines.append(f"| mean +- std | {cells} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[1, 2, 3],
                        help="comma-separated seeds (default 1,2,3)")
    parser.add_argument("--out", default="runs/arithmetic_demo")
    parser.add_argument("--chat-template", default="tiny", choices=["tiny", "qwen3"],
                        help="the model's chat template (qwen3: official, thinking off)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(CONFIG.parent))
    from make_model import make_model

    model = make_model(out / "model", chat_template=args.chat_template).resolve()
    overrides = [f"model.hf_path={model}", *args.overrides]
    if args.chat_template == "qwen3":
        # Qwen3's turns are longer (an empty think block each): the SFT cold start needs more steps
        # to teach the tool call as well (250 steps: held-out sampled reward 0.05-0.19 after SFT;
        # 400 steps: 0.79, 0.91 and 0.17, and seed 3 did not gain from GSPO; 600 steps: 0.78-0.81,
        # every seed gains). Overrides given on the command line come later and win.
        overrides[1:1] = ["rollout.agent.chat_template_kwargs={enable_thinking: false}", "sft.num_steps=600"]
    results = [run_seed(seed, out, overrides) for seed in args.seeds]
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    text = table(results, summary)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
