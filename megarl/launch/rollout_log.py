"""Trajectories on disk: ``run_dir/rollouts/step_N.jsonl`` (``logging.save_rollouts``), and the
``perf/mfu`` metric of a step; both computed by the driver after the step, off the hot path.

Each line is one trajectory (:func:`trajectory_record`). Since ``record_version`` 2 it also holds
``turns``: the response cut where ``loss_mask`` changes, each span decoded on its own, so a reader
(``megarl show``) sees the model turns (with their reasoning set apart by the family's SGLang
reasoning parser, their policy versions and token counts) and the observations appended between them
(loss-masked) without the tokenizer. Older lines (no ``turns``) keep only ``prompt``/``response``."""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megarl.launch.mfu import mfu, peak_tflops

RECORD_VERSION = 2
"""Version of a line's layout: 1 (no ``record_version`` key) without ``turns``; 2 with them."""


def _reasoning_format(tokenizer: Any) -> Any:
    """The family's reasoning format (``auto``, as the agent loop resolves it), or None where the
    family has none or is unknown: the turns are then shown without a reasoning split."""
    from megarl.rollout.reasoning import ReasoningFormat, resolve_parsers

    try:
        name, _ = resolve_parsers(tokenizer, "auto", "auto")
    except ValueError:
        return None
    return ReasoningFormat(name) if name else None


def _spans(loss_mask: list[int]) -> list[tuple[int, int, bool]]:
    """``(start, end, trained)`` runs of equal ``loss_mask`` values over ``[R]``."""
    spans, start = [], 0
    for i in range(1, len(loss_mask) + 1):
        if i == len(loss_mask) or bool(loss_mask[i]) != bool(loss_mask[start]):
            spans.append((start, i, bool(loss_mask[start])))
            start = i
    return spans


def turn_records(traj: Any, tokenizer: Any, reasoning: Any = None) -> list[dict[str, Any]]:
    """The response as turns: ``{"role": "model" | "observation", "text", "tokens", "trained",
    "policy_versions": [lo, hi]}``, model turns also with ``reasoning`` and ``answer``.

    Args:
        traj: a ``Trajectory`` (``response_ids [R]``, ``loss_mask [R]``, ``token_policy_versions
            [R]`` or None).
        tokenizer: the run's tokenizer (special tokens are kept in the text).
        reasoning: a ``ReasoningFormat``: a model turn starts inside reasoning when the text before
            it (the prompt, or the previous observation) left a reasoning block open, as in the agent
            loop; None: ``reasoning`` is empty and ``answer`` is the whole turn.
    """
    ids, mask = traj.response_ids.tolist(), traj.loss_mask.tolist()
    versions = (traj.token_policy_versions.tolist() if traj.token_policy_versions is not None
                else [int(traj.policy_version)] * len(ids))
    before = tokenizer.decode(traj.prompt_ids.tolist(), skip_special_tokens=False)
    turns = []
    for start, end, trained in _spans(mask):
        text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        turn = {"role": "model" if trained else "observation", "text": text, "tokens": end - start,
                "trained": trained, "policy_versions": [min(versions[start:end]), max(versions[start:end])]}
        if trained:
            eos = tokenizer.eos_token or ""
            body = text[:-len(eos)] if eos and text.endswith(eos) else text
            turn["reasoning"], turn["answer"] = (reasoning.split(body, in_reasoning=reasoning.leaves_open(before))
                                                 if reasoning else ("", body))
        before = text
        turns.append(turn)
    return turns


def trajectory_record(traj: Any, tokenizer: Any, prompt_key: str = "prompt",
                      reasoning: Any = None) -> dict[str, Any]:
    """One trajectory as a JSON-able dict: decoded prompt and response, its turns
    (:func:`turn_records`), token counts, tool calls and errors, reward and its terms (and the gold
    answer, where the reward records it), status,
    policy version and group id."""
    from megarl.rollout.rewards.keys import GOLD_KEY, TERMS_KEY

    prompt_ids, response_ids = traj.prompt_ids.tolist(), traj.response_ids.tolist()
    meta = traj.metadata or {}
    return {
        "record_version": RECORD_VERSION,
        "group_id": int(traj.group_id),
        "policy_version": int(traj.policy_version),
        "status": getattr(traj.status, "value", str(traj.status)),
        "reward": float(traj.reward),
        "reward_terms": {k: float(v) for k, v in (meta.get(TERMS_KEY) or {}).items()},
        **({"gold": str(meta[GOLD_KEY])} if GOLD_KEY in meta else {}),
        "num_turns": int(traj.num_turns),
        "tool_calls": meta.get("tool_calls", 0),
        "tool_errors": meta.get("tool_errors", 0),
        "prompt_tokens": len(prompt_ids),
        "response_tokens": len(response_ids),
        "trained_tokens": int(traj.loss_mask.sum().item()),
        "question": str((traj.sample or {}).get(prompt_key, "")),
        "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
        "response": tokenizer.decode(response_ids, skip_special_tokens=False),
        "turns": turn_records(traj, tokenizer, reasoning),
        **({"error": str(meta["error"])} if "error" in meta else {}),
    }


def write_rollouts(run_dir: Path, step: int, groups: Iterable[Any], tokenizer: Any,
                   prompt_key: str = "prompt") -> Path:
    """Write step ``step``'s trajectories (1-based step) to ``run_dir/rollouts/step_{step}.jsonl``."""
    out = Path(run_dir) / "rollouts"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_{step}.jsonl"
    reasoning = _reasoning_format(tokenizer)
    with path.open("w", encoding="utf-8") as f:
        for group in groups:
            for traj in group.trajectories:
                record = trajectory_record(traj, tokenizer, prompt_key, reasoning)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def mean_seq_len(groups: Iterable[Any]) -> float:
    """Mean prompt + response length (tokens) of the trajectories."""
    lens = [t.prompt_ids.numel() + t.response_ids.numel() for g in groups for t in g.trajectories]
    return sum(lens) / len(lens) if lens else math.nan


def gpu_name() -> str:
    """The first GPU's name from ``nvidia-smi`` ("" when it is absent or fails): no CUDA context is
    made in the driver (in a colocated run its GPU memory belongs to the engines and trainer)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def step_mfu(model_config: dict | None, metrics: dict[str, float], seq_len: float, num_devices: int,
             device_name: str, override: float | None) -> float:
    """``perf/mfu`` of a step from ``perf/tokens_per_s``; NaN without a model config, a throughput,
    or a known peak (a CPU or unlisted device with no ``logging.peak_tflops``)."""
    tps = metrics.get("perf/tokens_per_s")
    peak = peak_tflops(device_name, "bf16", override)
    if not model_config or tps is None or math.isnan(peak) or math.isnan(seq_len):
        return math.nan
    return mfu(model_config, tps, seq_len, num_devices, peak)
