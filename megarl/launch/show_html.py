"""``megarl show RUN --html OUT``: a run's trajectories as one self-contained page.

The page (inline CSS and script, no external asset) starts with the system prompt, shown once (the
text every prompt of the run starts with), and a list of trajectories, one row each: step, group,
reward, turns, tool calls and errors, status. The toolbar sorts the list by any of these and filters
it by status, a reward bound and a word of the question. Each row opens into the trajectory: the
prompt after the shared part, then turn by turn by role: model turns (trained tokens: reasoning set
apart, tool calls in their own block, the policy versions) and observations (tool outputs, loss-masked:
hatched grey and labelled, not trained), then the reward with its terms and the gold answer.

The query string sets the view on load (used by the browser test and to share a link):
``?sort=-reward`` (``-``: descending; ``reward``, ``turns``, ``tools``, ``step``, ``status``),
``&status=completed``, ``&max_reward=0.5``, ``&open=t1-0`` (a trajectory's id: step and position).
"""
from __future__ import annotations

import html
import os
import re
from collections.abc import Callable
from typing import Any

_TOOL_CALL = re.compile(r"(<tool_call>.*?</tool_call>|<｜tool▁calls▁begin｜>.*?<｜tool▁calls▁end｜>)", re.S)

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#1d1d1f;background:#fafafa}
h1{font-size:1.3em} pre{white-space:pre-wrap;word-break:break-word;margin:.3em 0;font:13px/1.4 monospace}
.toolbar{position:sticky;top:0;background:#fafafa;padding:.5em 0;border-bottom:1px solid #ccc;z-index:1}
.toolbar label{margin-right:1em}
.row{display:grid;grid-template-columns:5em 5em 6em 5em 7em 9em 1fr;gap:.5em;align-items:baseline}
.head{font-weight:600;padding:.3em .6em;cursor:pointer}
details.traj{border:1px solid #ccc;border-left:6px solid #c0392b;margin:.3em 0;background:#fff}
details.traj.good{border-left-color:#27ae60}
details.traj>summary{padding:.3em .6em;cursor:pointer;list-style:none}
details.traj>summary .q{overflow:hidden;text-overflow:ellipsis;white-space:nowrap;color:#555}
.body{padding:.5em 1em 1em}
.turn{margin:.5em 0;padding:.4em .7em;border-radius:4px}
.turn .label{font-size:12px;font-weight:600;text-transform:uppercase;letter-spacing:.03em}
.prompt{background:#f0f0f0;color:#555}
.trained{background:#eef6ff;border:1px solid #7fb3e6}
.masked{background:repeating-linear-gradient(45deg,#f3f3f3,#f3f3f3 6px,#e4e4e4 6px,#e4e4e4 12px);
 border:1px dashed #888;color:#444}
.reasoning{color:#7d3c98;font-style:italic;border-left:3px solid #c39bd3;padding-left:.6em}
.toolcall{background:#fff4d6;border:1px solid #e0b84c;padding:.2em .5em}
.reward{margin-top:.6em;font-weight:600} .error{color:#c0392b}
.system{background:#fff;border:1px solid #ccc;padding:.5em 1em;margin-bottom:1em}
"""

SCRIPT = """
const list=document.getElementById('list'), items=[...list.querySelectorAll('details.traj')];
const q=new URLSearchParams(location.search), f=document.forms.view;
for (const k of ['sort','status','max_reward','text']) if (q.get(k)!==null) f[k].value=q.get(k);
function apply(){
  const key=f.sort.value.replace('-',''), sign=f.sort.value.startsWith('-')?-1:1;
  const num=k=>x=>k==='status'?x.dataset.status:parseFloat(x.dataset[k]);
  items.sort((a,b)=>{const x=num(key)(a),y=num(key)(b);return sign*(x<y?-1:x>y?1:0)||a.dataset.order-b.dataset.order;});
  const bound=parseFloat(f.max_reward.value), text=f.text.value.toLowerCase(); let shown=0;
  for (const it of items){
    const ok=(!f.status.value||it.dataset.status===f.status.value)&&(isNaN(bound)||parseFloat(it.dataset.reward)<=bound)
      &&(!text||it.dataset.question.toLowerCase().includes(text));
    it.hidden=!ok; shown+=ok; list.appendChild(it);}
  document.getElementById('count').textContent=shown+' of '+items.length+' shown';
}
f.addEventListener('input',apply);
document.querySelectorAll('.head [data-key]').forEach(h=>h.onclick=()=>{
  f.sort.value=(f.sort.value===h.dataset.key?'-':'')+h.dataset.key; apply();});
document.getElementById('all').onclick=()=>{const o=!items.some(i=>i.open);items.forEach(i=>{if(!i.hidden)i.open=o;});};
if (q.get('open')) {const t=document.getElementById(q.get('open')); if (t) {t.open=true; t.scrollIntoView();}}
apply();
"""


def shared_prefix(prompts: list[str]) -> str:
    """The text every prompt starts with, cut after its last line break (the system prompt and the
    chat template's opening); empty for fewer than two prompts."""
    if len(prompts) < 2:
        return ""
    prefix = os.path.commonprefix(prompts)
    return prefix[: prefix.rfind("\n") + 1]


def _text(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _answer(text: str) -> str:
    """A model turn's answer with each tool call in its own block."""
    out = []
    for i, part in enumerate(_TOOL_CALL.split(text.strip())):
        if part.strip():
            out.append(f'<pre class="toolcall">{html.escape(part.strip())}</pre>' if i % 2 else _text(part.strip()))
    return "".join(out)


def _turn(turn: dict[str, Any], model_turn: int) -> str:
    if not turn["trained"]:
        return (f'<div class="turn masked"><div class="label">observation (tool output) | loss-masked, not trained | '
                f'{turn["tokens"]} tokens</div>{_text(turn["text"])}</div>')
    lo, hi = turn["policy_versions"]
    reasoning = turn.get("reasoning", "").strip()
    return (f'<div class="turn trained"><div class="label">model turn {model_turn} | trained | '
            f'{turn["tokens"]} tokens | policy v{lo}{"" if lo == hi else f"-v{hi}"}</div>'
            + (f'<div class="reasoning">{_text(reasoning)}</div>' if reasoning else "")
            + _answer(turn.get("answer", turn["text"])) + "</div>")


def _reward(row: dict[str, Any]) -> str:
    terms = " + ".join(f"{html.escape(k)} {v:g}" for k, v in row.get("reward_terms", {}).items())
    gold = row.get("gold")
    return (f'<div class="reward">reward {float(row["reward"]):g}' + (f" = {terms}" if terms else "")
            + (f" | gold answer: {html.escape(str(gold))}" if gold not in (None, "") else "")
            + f' | status {html.escape(row["status"])}</div>'
            + (f'<div class="error">error: {html.escape(row["error"])}</div>' if row.get("error") else ""))


def _trajectory(step: int, index: int, order: int, row: dict[str, Any], prefix: str) -> str:
    turns, model_turn, body = row.get("turns"), 0, []
    for turn in turns if turns is not None else [{"trained": True, "text": row["response"],
                                                    "tokens": row["response_tokens"],
                                                    "policy_versions": [row["policy_version"]] * 2}]:
        model_turn += bool(turn["trained"])
        body.append(_turn(turn, model_turn))
    prompt = row["prompt"][len(prefix):] if prefix and row["prompt"].startswith(prefix) else row["prompt"]
    reward = float(row["reward"])
    question = str(row.get("question") or prompt)
    cells = [f"step {step}", f"#{index}", f"{reward:g}", str(row.get("num_turns", model_turn)),
             f"{row.get('tool_calls', 0)} ({row.get('tool_errors', 0)} err)", row["status"], question]
    data = (f'data-step="{step}" data-order="{order}" data-reward="{reward}" '
            f'data-turns="{row.get("num_turns", model_turn)}" '
            f'data-tools="{row.get("tool_calls", 0)}" data-status="{html.escape(row["status"])}" '
            f'data-question="{html.escape(question)}"')
    summary = "".join(f'<span{" class=q" if i == 6 else ""}>{html.escape(c)}</span>' for i, c in enumerate(cells))
    return (f'<details class="traj{" good" if reward > 0 else ""}" id="t{step}-{index}" {data}>'
            f'<summary class="row">{summary}</summary><div class="body">'
            f'<div class="turn prompt"><div class="label">prompt | {row["prompt_tokens"]} tokens (after the system '
            f'prompt)</div>{_text(prompt)}</div>{"".join(body)}{_reward(row)}</div></details>')


def _toolbar(statuses: list[str]) -> str:
    options = "".join(f'<option value="{html.escape(s)}">{html.escape(s)}</option>' for s in statuses)
    sorts = "".join(f'<option value="{v}">{t}</option>' for v, t in (
        ("step", "step"), ("-reward", "reward, high first"), ("reward", "reward, low first"),
        ("-turns", "turns"), ("-tools", "tool calls"), ("status", "status")))
    return (f'<form name="view" class="toolbar" onsubmit="return false"><label>sort <select name="sort">{sorts}'
            f'</select></label><label>status <select name="status"><option value="">all</option>{options}</select>'
            '</label><label>reward &le; <input name="max_reward" size="5"></label><label>question contains '
            '<input name="text" size="16"></label><button type="button" id="all">open / close all</button> '
            '<span id="count"></span></form>')


def page(title: str, steps: dict[int, list[dict[str, Any]]], keep: Callable[[dict[str, Any]], bool]) -> str:
    """The HTML page of ``steps`` (``{step: [trajectory records]}``) with the rows ``keep`` accepts.

    Returns:
        One HTML document (inline CSS and script; nothing loaded from elsewhere).
    """
    rows = [(step, i, row) for step, step_rows in steps.items()
            for i, row in enumerate(r for r in step_rows if keep(r))]
    prefix = shared_prefix([row["prompt"] for _, _, row in rows])
    items = "".join(_trajectory(step, i, order, row, prefix) for order, (step, i, row) in enumerate(rows))
    head = "".join(f'<span data-key="{k}">{t}</span>' for k, t in (
        ("step", "step"), ("step", "#"), ("reward", "reward"), ("turns", "turns"), ("tools", "tool calls"),
        ("status", "status"))) + "<span>question</span>"
    system = (f'<details class="system" open><summary>system prompt and template opening, shared by all '
              f'{len(rows)} prompts (shown once)</summary>{_text(prefix)}</details>' if prefix else "")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{system}'
            f'{_toolbar(sorted({row["status"] for _, _, row in rows}))}<div class="row head">{head}</div>'
            f'<div id="list">{items}</div><script>{SCRIPT}</script></body></html>')
