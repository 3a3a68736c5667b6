"""``megarl show RUN_DIR``: a run's trajectories turn by turn, in the terminal or as one HTML page.

Reads ``RUN_DIR/rollouts/step_N.jsonl`` (:mod:`megarl.launch.rollout_log`). Per step a summary line
(trajectories, mean reward, truncation rate, response tokens, tool calls and errors, policy versions),
then each trajectory: the prompt, each model turn (its reasoning set apart, its trained token count
and policy versions), each observation the agent loop appended (loss-masked: not trained), the
status, and the reward with its terms. ``--html OUT`` writes one self-contained page to sort, filter
and open trajectory by trajectory (:mod:`megarl.launch.show_html`).
"""
from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megarl.errors import UserError

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "=": operator.eq, "!=": operator.ne}
_REWARD = re.compile(r"^\s*reward\s*(<=|>=|==|!=|<|>|=)\s*(-?[0-9.eE+-]+)\s*$")
FILTERS = ("reward<X (also <=, >, >=, ==, !=)", "truncated", "tool_error")
"""What ``--filter`` accepts."""


class ShowError(UserError):
    """The run directory, the step or the filter cannot be shown (names which)."""


def parse_filter(expr: str | None) -> Callable[[dict[str, Any]], bool]:
    """The predicate of a ``--filter`` expression over one trajectory record.

    Args:
        expr: ``reward<0.5`` (any of ``< <= > >= == !=``), ``truncated`` (status truncated),
            ``tool_error`` (at least one tool call failed), or None (every trajectory).

    Raises:
        ShowError: an expression of none of these forms (names ``--filter``).
    """
    if expr is None:
        return lambda row: True
    if expr.strip() == "truncated":
        return lambda row: row.get("status") == "truncated"
    if expr.strip() == "tool_error":
        return lambda row: int(row.get("tool_errors", 0)) > 0
    match = _REWARD.match(expr)
    if match is None:
        raise ShowError(f"--filter {expr!r}: expected one of {', '.join(FILTERS)}")
    op, threshold = _OPS[match.group(1)], float(match.group(2))
    return lambda row: op(float(row["reward"]), threshold)


def load_steps(run_dir: str | Path, step: int | None = None) -> dict[int, list[dict[str, Any]]]:
    """``{step: [trajectory records]}`` of ``run_dir/rollouts/step_N.jsonl``, in step order.

    Raises:
        ShowError: no rollouts directory or files (``logging.save_rollouts`` off?), or no file for
            ``step`` (names the steps there are).
    """
    folder = Path(run_dir) / "rollouts"
    files = {int(m.group(1)): p for p in folder.glob("step_*.jsonl")
             if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name))}
    if not files:
        raise ShowError(f"{folder}: no step_N.jsonl files (the run writes them with logging.save_rollouts=true)")
    if step is not None and step not in files:
        raise ShowError(f"--step {step}: {folder} has steps {', '.join(map(str, sorted(files)))}")
    chosen = [step] if step is not None else sorted(files)
    return {s: [json.loads(line) for line in files[s].read_text(encoding="utf-8").splitlines() if line.strip()]
            for s in chosen}


def step_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-step numbers over its trajectories: ``trajectories``, ``reward_mean``, ``truncated_frac``,
    ``response_tokens_mean``, ``trained_tokens_mean``, ``tool_calls`` and ``tool_errors`` (sums),
    ``policy_version_min`` / ``_max`` (over every token)."""
    n = max(len(rows), 1)
    versions = [v for row in rows for v in _versions(row)]
    return {
        "trajectories": len(rows),
        "reward_mean": sum(float(r["reward"]) for r in rows) / n,
        "truncated_frac": sum(r.get("status") == "truncated" for r in rows) / n,
        "response_tokens_mean": sum(int(r["response_tokens"]) for r in rows) / n,
        "trained_tokens_mean": sum(int(r["trained_tokens"]) for r in rows) / n,
        "tool_calls": sum(int(r.get("tool_calls", 0)) for r in rows),
        "tool_errors": sum(int(r.get("tool_errors", 0)) for r in rows),
        "policy_version_min": min(versions, default=0),
        "policy_version_max": max(versions, default=0),
    }


def _versions(row: dict[str, Any]) -> list[int]:
    turns = row.get("turns") or []
    return [v for t in turns for v in t["policy_versions"]] or [int(row["policy_version"])]


def _span(versions: Iterable[int]) -> str:
    lo, hi = min(versions), max(versions)
    return f"v{lo}" if lo == hi else f"v{lo}-v{hi}"


def _summary_line(step: int, rows: list[dict[str, Any]], shown: int) -> str:
    s = step_summary(rows)
    return (f"step {step}: {s['trajectories']} trajectories ({shown} shown) | reward mean {s['reward_mean']:.3f} | "
            f"truncated {s['truncated_frac']:.0%} | response tokens mean {s['response_tokens_mean']:.1f} "
            f"(trained {s['trained_tokens_mean']:.1f}) | tool calls {s['tool_calls']}, errors {s['tool_errors']} | "
            f"policy {_span([int(s['policy_version_min']), int(s['policy_version_max'])])}")


def _turn_panels(row: dict[str, Any]) -> list[Any]:
    """One rich renderable per turn (old records without ``turns``: the response as one block)."""
    from rich.panel import Panel
    from rich.text import Text

    turns = row.get("turns")
    if turns is None:
        return [Panel(Text(row["response"]), title="response (record without turns)", title_align="left")]
    panels, model_turn = [], 0
    for turn in turns:
        if turn["role"] == "observation":
            panels.append(Panel(Text(turn["text"], style="yellow"), border_style="yellow", title_align="left",
                                title=f"observation | loss-masked, not trained | {turn['tokens']} tokens"))
            continue
        model_turn += 1
        parts = Text()
        if turn.get("reasoning"):
            parts.append("reasoning: ", style="bold magenta")
            parts.append(turn["reasoning"].strip() + "\n", style="italic magenta")
        parts.append(turn.get("answer", turn["text"]).strip())
        panels.append(Panel(parts, border_style="cyan", title_align="left",
                            title=f"model turn {model_turn} | trained | {turn['tokens']} tokens | "
                                  f"policy {_span(turn['policy_versions'])}"))
    return panels


def _trajectory(row: dict[str, Any], index: int) -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    terms = ", ".join(f"{k} {v:g}" for k, v in row.get("reward_terms", {}).items())
    footer = Text(f"status {row['status']} | reward {float(row['reward']):g}" + (f" ({terms})" if terms else "")
                  + f" | tool calls {row.get('tool_calls', 0)}, errors {row.get('tool_errors', 0)}"
                  + (f" | error: {row['error']}" if row.get("error") else ""), style="bold")
    prompt = Panel(Text(row["prompt"], style="dim"), title=f"prompt | {row['prompt_tokens']} tokens",
                   title_align="left", border_style="dim")
    reward_style = "green" if float(row["reward"]) > 0 else "red"
    return Panel(Group(prompt, *_turn_panels(row), footer), border_style=reward_style, title_align="left",
                 title=f"trajectory {index} | group {row['group_id']} | policy {_span(_versions(row))} | "
                       f"{row['response_tokens']} response tokens ({row['trained_tokens']} trained)")


def render(console: Any, steps: dict[int, list[dict[str, Any]]], keep: Callable[[dict[str, Any]], bool]) -> int:
    """Print every step's summary and its kept trajectories to a rich ``console``; how many were shown."""
    from rich.rule import Rule

    total = 0
    for step, rows in steps.items():
        kept = [r for r in rows if keep(r)]
        console.print(Rule(f"step {step}"))
        console.print(_summary_line(step, rows, len(kept)), highlight=False)
        for i, row in enumerate(kept):
            console.print(_trajectory(row, i))
        total += len(kept)
    return total


def show(run_dir: str | Path, *, step: int | None = None, filter_expr: str | None = None,
         html_out: str | Path | None = None, console: Any = None, width: int = 120) -> int:
    """Render a run's trajectories: to ``console`` (default: the terminal), and with ``html_out`` also
    as one HTML page.

    Returns:
        The number of trajectories shown.

    Raises:
        ShowError: see :func:`load_steps` and :func:`parse_filter`; ``html_out``'s directory is missing.
    """
    from rich.console import Console

    keep = parse_filter(filter_expr)
    if html_out is not None and not Path(html_out).resolve().parent.is_dir():  # before printing the run
        raise ShowError(f"--html {html_out}: the directory {Path(html_out).resolve().parent} does not exist")
    steps = load_steps(run_dir, step)
    console = console or Console()
    shown = render(console, steps, keep)
    if html_out is not None:
        from megarl.launch.show_html import page

        Path(html_out).write_text(page(f"megarl show {Path(run_dir).name}", steps, keep), encoding="utf-8")
    return shown


def add_show_parser(sub: Any) -> None:
    """The ``megarl show`` subcommand's arguments."""
    p = sub.add_parser("show", help="a run's trajectories turn by turn (terminal, or --html OUT)")
    p.add_argument("run_dir", help="the run directory (holds rollouts/step_N.jsonl)")
    p.add_argument("--step", type=int, default=None, help="only this step (default: every step)")
    p.add_argument("--filter", default=None, help=f"only trajectories matching: {' | '.join(FILTERS)}")
    p.add_argument("--html", default=None, metavar="OUT", help="also write one self-contained HTML page")


def cmd_show(args: Any) -> int:
    """``megarl show``: 0 when something was shown or written."""
    shown = show(args.run_dir, step=args.step, filter_expr=args.filter, html_out=args.html)
    if args.html:
        print(f"wrote {args.html} ({shown} trajectories)")
    return 0
