"""Supervised demonstrations (SFT cold start) tokenised the way rollouts are.

A demonstration is a list of chat messages (system, user, assistant with ``tool_calls``, tool,
assistant, ...). It becomes a :class:`~megarl.rollout.types.Trajectory` whose token ids are laid
out exactly as the agent loop lays out a rollout: the prompt rendered once with the generation
prompt, then, segment by segment, what the model would generate (assistant text up to and including
the end-of-turn token, ``loss_mask`` 1) and what the agent loop appends (the rest of the template
and tool observations, ``loss_mask`` 0). Each segment is tokenised on its own, as the agent loop
tokenises only the appended suffix — so the SFT'd policy sees the same token boundaries in RL.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megarl.rollout.types import RolloutStatus, Trajectory


class DemonstrationError(ValueError):
    """A demonstration does not render as a sequence of growing prefixes of the chat template."""


def _render(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         tokenize=False, add_generation_prompt=gen_prompt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def demonstration_to_trajectory(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                                tools: Sequence[dict] | None = None, end_of_turn: str | None = None,
                                group_id: int = 0) -> Trajectory:
    """Tokenise one demonstration into a trajectory with a loss mask on the assistant's tokens.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: chat messages; the first assistant message starts the response.
        tools: OpenAI-style tool schemas rendered into the system prompt (as in rollouts).
        end_of_turn: the token that ends a model turn (default ``tokenizer.eos_token``); it is
            trained (loss_mask 1), the template text after it is not.
        group_id: stored on the trajectory.

    Returns:
        A trajectory: ``prompt_ids [P]``, ``response_ids [R]``, ``loss_mask [R]`` (1 on assistant
        tokens), ``rollout_logprobs [R]`` zeros, ``reward`` 0, ``metadata["sft"] = True``.

    Raises:
        DemonstrationError: no assistant message, or the template is not prefix-stable.
    """
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DemonstrationError("a demonstration needs at least one assistant message")
    eot = end_of_turn or tokenizer.eos_token
    first = roles.index("assistant")
    prompt_text = _render(tokenizer, messages[:first], tools, True)
    prev = prompt_text
    response: list[int] = []
    mask: list[int] = []
    for k in range(first, len(messages)):
        gen_prompt = k + 1 < len(messages) and roles[k + 1] == "assistant"
        text = _render(tokenizer, messages[:k + 1], tools, gen_prompt)
        if not text.startswith(prev):
            raise DemonstrationError(f"message {k}: the chat template re-renders earlier messages "
                                     "differently; cannot split into turns")
        delta, prev = text[len(prev):], text
        if roles[k] == "assistant":
            cut = delta.find(eot)
            if cut < 0:
                raise DemonstrationError(f"message {k}: assistant turn has no end-of-turn {eot!r}")
            model_part, rest = delta[:cut + len(eot)], delta[cut + len(eot):]
            ids = _encode(tokenizer, model_part)
            response += ids
            mask += [1] * len(ids)
            delta = rest
        ids = _encode(tokenizer, delta)
        response += ids
        mask += [0] * len(ids)
    return Trajectory(
        prompt_ids=torch.tensor(_encode(tokenizer, prompt_text), dtype=torch.int64),
        response_ids=torch.tensor(response, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.int64),
        rollout_logprobs=torch.zeros(len(response), dtype=torch.float32),
        status=RolloutStatus.COMPLETED, num_turns=roles.count("assistant"), group_id=group_id,
        metadata={"sft": True})


def _gsm8k_python(rows: Sequence[dict], *, system_prompt: str | None, tool_fraction: float,
                  seed: int) -> list[list[dict[str, Any]]]:
    from megarl.data.gsm8k import python_demonstration

    demos = [python_demonstration(r, system_prompt=system_prompt) for r in rows]
    return [d for d in demos if d is not None]


def _arithmetic_calculator(rows: Sequence[dict], *, system_prompt: str | None, tool_fraction: float,
                           seed: int) -> list[list[dict[str, Any]]]:
    from megarl.data.arithmetic import demonstrations

    return demonstrations(list(rows), tool_fraction=tool_fraction, seed=seed, system_prompt=system_prompt)


DEMONSTRATION_BUILDERS = {"gsm8k_python": _gsm8k_python, "arithmetic_calculator": _arithmetic_calculator}
"""``sft.demonstrations`` registry: name -> builder(rows, system_prompt=, tool_fraction=, seed=)."""


def load_demonstrations(source: str, rows: Sequence[dict], *, system_prompt: str | None,
                        tool_fraction: float, seed: int, limit: int) -> list[list[dict[str, Any]]]:
    """Demonstrations (lists of chat messages) from a builder name or a file of ``messages`` rows.

    Args:
        source: a key of :data:`DEMONSTRATION_BUILDERS`, or a jsonl/parquet path.
        rows: the training prompt rows (builders turn them into demonstrations).
        system_prompt: prepended by builders (a file's messages are used as they are).
        tool_fraction, seed: builder settings.
        limit: keep at most this many.

    Raises:
        ValueError: neither a builder nor a readable file, a file row without ``messages``, or no
            demonstration at all (names ``sft.demonstrations``).
    """
    from pathlib import Path

    from megarl.data.datasets import read_rows

    if source in DEMONSTRATION_BUILDERS:
        demos = DEMONSTRATION_BUILDERS[source](rows[:limit * 2], system_prompt=system_prompt,
                                               tool_fraction=tool_fraction, seed=seed)
    elif Path(source).is_file():
        file_rows = read_rows(source)
        for i, row in enumerate(file_rows):
            if not isinstance(row.get("messages"), list):
                raise ValueError(f"sft.demonstrations: {source} row {i} has no 'messages' list")
        demos = [row["messages"] for row in file_rows]
    else:
        raise ValueError(f"sft.demonstrations: {source!r} is neither a builder "
                         f"({sorted(DEMONSTRATION_BUILDERS)}) nor an existing file")
    if not demos:
        raise ValueError(f"sft.demonstrations: {source!r} produced no demonstration")
    return demos[:limit]
