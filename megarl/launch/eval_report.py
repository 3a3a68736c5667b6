"""``megarl eval``'s report: per-trajectory records in, a JSON-ready summary and a console table out.

The records are :func:`megarl.rollout.trajectory_stats.trajectory_record`'s, as
:meth:`megarl.launch.rollout_actor.RolloutWorker.evaluate_records` returns them: ``greedy`` (one
trajectory per prompt, temperature 0) and ``sampled`` (n per prompt, the training sampling
settings and seeds). A prompt whose group failed has fewer records than it should: its missing
trajectories count as wrong, reward 0, as in the training run's evaluation.
"""
from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megarl.algorithms.pass_at_k import mean_pass_at_k

CORRECT_REWARD = 1.0 - 1e-6
"""A trajectory is correct when its reward is at least this (the training run's ``eval/accuracy`` rule)."""


def summarize(records: Sequence[Mapping[str, Any]], *, num_prompts: int, per_prompt: int,
              ks: Sequence[int] = ()) -> dict[str, Any]:
    """Statistics of one evaluation mode.

    Args:
        records: the mode's trajectory records (``prompt``, ``reward``, ``status``, ``tool_calls``,
            ``tool_errors``, ``response_tokens``, ``truncated``).
        num_prompts: prompts evaluated; per_prompt: trajectories asked for per prompt.
        ks: pass@k budgets to report (each ``<= per_prompt``).

    Returns:
        ``num_trajectories`` (asked for), ``num_failed`` (missing or ``error`` / ``aborted``),
        ``accuracy`` and ``reward_mean`` over every trajectory asked for (missing ones: 0);
        ``tool_calls_mean``, ``tool_errors_mean``, ``response_tokens_mean`` and ``truncation_rate``
        over the trajectories generated; ``pass@k`` per k (Chen et al. 2021, unbiased).
    """
    expected = num_prompts * per_prompt
    done = list(records)
    failed = expected - len(done) + sum(r["status"] in ("error", "aborted") for r in done)
    correct = [r for r in done if r["reward"] >= CORRECT_REWARD]
    out: dict[str, Any] = {
        "num_trajectories": expected, "num_failed": failed,
        "accuracy": len(correct) / expected if expected else float("nan"),
        "reward_mean": sum(r["reward"] for r in done) / expected if expected else float("nan"),
    }
    for key, name in (("tool_calls", "tool_calls_mean"), ("tool_errors", "tool_errors_mean"),
                      ("response_tokens", "response_tokens_mean"), ("truncated", "truncation_rate")):
        out[name] = sum(r[key] for r in done) / len(done) if done else float("nan")
    per = collections.Counter(r["prompt"] for r in correct)
    counts = [(per_prompt, min(per[p], per_prompt)) for p in range(num_prompts)]
    out["pass@k"] = {str(k): mean_pass_at_k(counts, k) for k in ks}
    return out


def build_report(records: Mapping[str, Sequence[Mapping[str, Any]]], *, num_prompts: int, samples_per_prompt: int,
                 ks: Sequence[int], run_metrics: Mapping[str, float], source: Mapping[str, Any]) -> dict[str, Any]:
    """The whole report (what ``--out`` holds).

    Args:
        records: ``{"greedy": [...], "sampled": [...]}``.
        num_prompts: evaluation prompts; samples_per_prompt: n of the sampled mode (0: none).
        ks: pass@k budgets for the sampled mode.
        run_metrics: the ``eval/*`` metrics exactly as the training run logs them.
        source: what was evaluated (checkpoint, HF directory, data path, config, policy version).

    Returns:
        ``{"source", "num_prompts", "samples_per_prompt", "greedy", "sampled" (or None),
        "eval_metrics", "trajectories"}``.
    """
    sampled = (summarize(records.get("sampled", ()), num_prompts=num_prompts, per_prompt=samples_per_prompt, ks=ks)
               if samples_per_prompt > 0 else None)
    return {"source": dict(source), "num_prompts": num_prompts, "samples_per_prompt": samples_per_prompt,
            "greedy": summarize(records.get("greedy", ()), num_prompts=num_prompts, per_prompt=1, ks=(1,)),
            "sampled": sampled, "eval_metrics": dict(run_metrics),
            "trajectories": {mode: list(rows) for mode, rows in records.items()}}


def write_report(report: Mapping[str, Any], path: Path) -> Path:
    """Write ``report`` as indented JSON (NaN as ``null``); returns ``path``."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and value != value:
            return None
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(report), indent=2) + "\n", encoding="utf-8")
    return path


ROWS = (("accuracy", "accuracy", "{:.3f}"), ("reward_mean", "reward (mean)", "{:.3f}"),
        ("tool_calls_mean", "tool calls / traj.", "{:.2f}"), ("tool_errors_mean", "tool errors / traj.", "{:.2f}"),
        ("response_tokens_mean", "response tokens (mean)", "{:.1f}"), ("truncation_rate", "truncated", "{:.3f}"),
        ("num_failed", "failed", "{}"), ("num_trajectories", "trajectories", "{}"))


def report_table(report: Mapping[str, Any]) -> Any:
    """A ``rich`` table: one row per statistic, one column per mode (greedy, sampled), then pass@k."""
    from rich.table import Table

    greedy, sampled = report["greedy"], report["sampled"]
    n = report["samples_per_prompt"]
    table = Table(title=f"megarl eval: {report['num_prompts']} prompts ({report['source'].get('model', '')})")
    table.add_column("metric")
    table.add_column("greedy", justify="right")
    if sampled is not None:
        table.add_column(f"sampled (n={n})", justify="right")

    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None or value != value else fmt.format(value)

    for key, name, fmt in ROWS:
        table.add_row(name, cell(greedy[key], fmt), *([cell(sampled[key], fmt)] if sampled is not None else []))
    for k, value in (sampled or {}).get("pass@k", {}).items():
        table.add_row(f"pass@{k}", "", cell(value, "{:.3f}"))
    return table


def print_report(report: Mapping[str, Any], console: Any = None) -> None:
    """Print :func:`report_table` (to ``console``, default a new ``rich`` console on stdout)."""
    from rich.console import Console

    (console or Console()).print(report_table(report))
