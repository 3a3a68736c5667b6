"""Turn-by-turn checks of token-in-token-out trajectories, valid for any chat template.

A full re-render of the conversation is no reference for templates that re-render history
differently (Qwen3 drops earlier ``<think>`` blocks, DeepSeek-R1 strips reasoning); what must hold for
every template is what the engine was given and what it returned, turn by turn.
"""
from __future__ import annotations


def record_outputs(engine):
    """Make a ScriptedEngine also record each call's returned ids as ``calls[k]["output_ids"]``."""
    generate = engine.generate

    async def recording_generate(input_ids, sampling_params, **kwargs):
        out = await generate(input_ids, sampling_params, **kwargs)
        engine.calls[-1]["output_ids"] = list(out.output_ids)
        return out

    engine.generate = recording_generate
    return engine


def assert_engine_inputs_are_prefixes(engine, trajectory) -> None:
    """Every engine input is a prefix of the final sequence, each turn's output follows its input
    there verbatim, each input extends the previous input + output, the sequence ends with the last
    output, and ``loss_mask`` is 1 exactly on the generated tokens (``engine`` made by
    :func:`record_outputs`)."""
    full = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
    prompt_len = trajectory.prompt_ids.numel()
    mask = [0] * (len(full) - prompt_len)
    end = prompt_len
    for k, call in enumerate(engine.calls):
        inp, out = call["input_ids"], call["output_ids"]
        assert len(inp) >= end and full[:len(inp)] == inp, f"engine input {k} is not a prefix of the sequence"
        assert full[len(inp):len(inp) + len(out)] == out, f"output {k} is not where it was generated"
        mask[len(inp) - prompt_len:len(inp) - prompt_len + len(out)] = [1] * len(out)
        end = len(inp) + len(out)
    assert end == len(full), "tokens were appended after the last model turn"
    assert trajectory.loss_mask.tolist() == mask
