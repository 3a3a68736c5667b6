"""Trajectories on disk: ``run_dir/rollouts/step_N.jsonl`` (``logging.save_rollouts``), written by
the driver after the step (:class:`RolloutWriter`), off the hot path.

Each line is one trajectory (:func:`trajectory_record`). Since ``record_version`` 2 it also holds
``turns``: the response cut where ``loss_mask`` changes, each span decoded on its own, so a reader
(``megarl show``) sees the model turns (with their reasoning set apart by the family's SGLang
reasoning parser, their policy versions and token counts) and the observations appended between them
(loss-masked) without the tokenizer. Older lines (no ``turns``) keep only ``prompt``/``response``."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


@dataclasses.dataclass
class RolloutWriter:
    """Writes each step's trajectories (:func:`write_rollouts`) when ``logging.save_rollouts`` is set
    and the run has a model; the tokenizer is loaded once, on first use."""

    run_dir: Path
    """The run directory (``rollouts/`` is made in it)."""
    tokenizer_path: str | None
    """``model.tokenizer_path`` or ``model.hf_path``; None: nothing is written (stand-in runs)."""
    prompt_key: str
    """``data.prompt_key`` (the question's field in a row)."""
    enabled: bool
    """``logging.save_rollouts``."""

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer of :attr:`tokenizer_path`."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path)

    def write(self, step: int, groups: Iterable[Any]) -> Path | None:
        """Write step ``step``'s (1-based) trajectories; returns the file, or None when disabled."""
        if not self.enabled or self.tokenizer_path is None:
            return None
        return write_rollouts(self.run_dir, step, groups, self.tokenizer, prompt_key=self.prompt_key)
