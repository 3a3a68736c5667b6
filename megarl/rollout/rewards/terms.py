"""Reward terms for :mod:`~megarl.rollout.rewards.composite` (each is also a reward on its own).

- ``exact_match``: Search-R1's outcome reward (Jin et al. 2025, arXiv:2503.09516): 1.0 when the
  normalised final answer equals a normalised reference, else 0.0. Normalisation as SQuAD's
  ``normalize_answer`` (Rajpurkar et al. 2016): lowercase, drop punctuation, drop the articles
  a/an/the, collapse whitespace. The answer is the text of the last ``<answer>...</answer>`` of the
  final turn (Search-R1's tag); with ``require_tag: false`` a final turn without the tag is compared
  whole.
- ``answer_format``: 1.0 when the final turn holds exactly one ``<answer>...</answer>`` with text.
- ``tool_success_rate``: (tool calls - tool errors) / tool calls of the trajectory (the agent loop's
  counts); ``no_calls_value`` when it made none.
- ``turn_penalty``: ``-max(0, num_turns - free_turns)``.
- ``overlong_penalty``: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13)
  with ``L_max = max_tokens`` and ``L_cache = buffer_tokens``: 0 when ``|y| <= L_max - L_cache``,
  ``((L_max - L_cache) - |y|) / L_cache`` up to ``L_max``, -1 beyond. Deviation: ``|y|`` counts the
  policy's own tokens (``loss_mask`` 1), not tool observations, which the policy does not write.
"""
from __future__ import annotations

import re
import string
from typing import TYPE_CHECKING, Any

from megarl.rollout.rewards.keys import FINAL_TEXT_KEY
from megarl.rollout.rewards.reward_registry import register_reward

if TYPE_CHECKING:
    from megarl.rollout.types import Trajectory

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 answer normalisation (lowercase, no punctuation, no articles, single spaces)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def extract_answer(text: str, *, require_tag: bool = True) -> str | None:
    """The last ``<answer>...</answer>`` of ``text``; without one, None (or the text, when not required)."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    return None if require_tag else text.strip()


def _final_text(trajectory: Trajectory) -> str:
    if FINAL_TEXT_KEY not in trajectory.metadata:
        raise KeyError(f"trajectory.metadata[{FINAL_TEXT_KEY!r}] is missing")
    return str(trajectory.metadata[FINAL_TEXT_KEY])


@register_reward("exact_match")
class ExactMatch:
    """Normalised exact match of the final answer against ``sample[answer_key]`` (a string or a list
    of accepted aliases).

    Raises (on call):
        KeyError: the sample has no ``answer_key``.
    """

    def __init__(self, *, answer_key: str = "answer", require_tag: bool = True) -> None:
        self.answer_key = answer_key
        self.require_tag = bool(require_tag)

    def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        if self.answer_key not in sample:
            raise KeyError(f"exact_match: sample has no {self.answer_key!r} field (fields: {sorted(sample)})")
        refs = sample[self.answer_key]
        refs = [refs] if isinstance(refs, str) else list(refs)
        answer = extract_answer(_final_text(trajectory), require_tag=self.require_tag)
        if answer is None:
            return 0.0
        return float(normalize_answer(answer) in {normalize_answer(str(r)) for r in refs})


@register_reward("answer_format")
class AnswerFormat:
    """1.0 when the final turn has exactly one non-empty ``<answer>...</answer>``, else 0.0."""

    def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        found = _ANSWER.findall(_final_text(trajectory))
        return float(len(found) == 1 and bool(found[0].strip()))


@register_reward("tool_success_rate")
class ToolSuccessRate:
    """Fraction of the trajectory's tool calls that did not return an error."""

    def __init__(self, *, no_calls_value: float = 0.0) -> None:
        self.no_calls_value = float(no_calls_value)

    def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        calls = int(trajectory.metadata.get("tool_calls", 0))
        if calls == 0:
            return self.no_calls_value
        return (calls - int(trajectory.metadata.get("tool_errors", 0))) / calls


@register_reward("turn_penalty")
class TurnPenalty:
    """``-max(0, num_turns - free_turns)`` (generate calls beyond the free ones)."""

    def __init__(self, *, free_turns: int = 1) -> None:
        self.free_turns = int(free_turns)

    def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        return -float(max(0, trajectory.num_turns - self.free_turns))


@register_reward("overlong_penalty")
class OverlongPenalty:
    """DAPO's soft overlong punishment over the policy's tokens (see the module docstring).

    Raises:
        ValueError: ``buffer_tokens`` not in (0, max_tokens].
    """

    def __init__(self, *, max_tokens: int, buffer_tokens: int) -> None:
        if not 0 < int(buffer_tokens) <= int(max_tokens):
            raise ValueError(f"overlong_penalty: buffer_tokens must be in (0, max_tokens], "
                             f"got {buffer_tokens} with max_tokens {max_tokens}")
        self.max_tokens, self.buffer_tokens = int(max_tokens), int(buffer_tokens)

    def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        length = trajectory.num_model_tokens
        soft = self.max_tokens - self.buffer_tokens
        if length <= soft:
            return 0.0
        if length <= self.max_tokens:
            return (soft - length) / self.buffer_tokens
        return -1.0
