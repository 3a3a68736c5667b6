"""Verification of a weight push: engine logprobs on probe sequences against the trainer's.

SGLang reports success for tensors it silently ignored, so the only proof that the engines serve
the new policy is their output. After a sync, :func:`verify_engine_logprobs` asks every engine for
the teacher-forced logprobs of a few probe sequences (``/generate`` with ``logprob_start_len=0``)
and compares them with the trainer's logprobs of the same tokens.

Metric: ``mean |engine - trainer|`` over all probe tokens (and the max), per engine; the check
fails when the mean exceeds ``tolerance`` (``weight_sync.verify_tolerance``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.weight_sync.engine_clients import EngineClients
from megarl.weight_sync.manifest_checks import WeightSyncError


def engine_prompt_logprobs(engines: EngineClients, probes: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """``[engine][probe] -> [P - 1]`` float64 teacher-forced logprobs from every engine.

    One probe at a time (all engines in parallel): a probe batched with others can come out
    different in the last bits, and verification should compare weights, not batching.
    """
    per_engine: list[list[torch.Tensor]] = [[] for _ in range(len(engines))]
    for probe in probes:
        for i, result in enumerate(engines.call_all("prompt_logprobs", list(probe))):
            per_engine[i].append(torch.tensor(result, dtype=torch.float64))
    return per_engine


def logprob_gap(engine: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor]) -> tuple[float, float]:
    """``(mean, max)`` absolute difference over all tokens of all probes.

    Args:
        engine / trainer: per probe, ``[P - 1]`` logprobs of tokens 1..P-1.

    Raises:
        ValueError: different numbers of probes or tokens.
    """
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine probes vs {len(trainer)} trainer probes")
    diffs = []
    for i, (e, t) in enumerate(zip(engine, trainer)):
        if e.shape != t.shape:
            raise ValueError(f"probe {i}: engine logprobs {tuple(e.shape)} vs trainer {tuple(t.shape)}")
        diffs.append((e.double() - t.double()).abs())
    flat = torch.cat(diffs)
    return flat.mean().item(), flat.max().item()


def verify_engine_logprobs(engines: EngineClients, probes: Sequence[Sequence[int]],
                           trainer_logprobs: Sequence[torch.Tensor], *, tolerance: float) -> dict[str, float]:
    """Check every engine against the trainer on the probes.

    Args:
        engines: the engines that were just updated.
        probes: token-id sequences.
        trainer_logprobs: per probe, the trainer's ``[P - 1]`` logprobs of tokens 1..P-1.
        tolerance: largest allowed mean absolute difference.

    Returns:
        ``weight_sync/verify_logprob_diff_mean`` and ``..._max`` (worst engine).

    Raises:
        WeightSyncError: an engine's mean difference exceeds ``tolerance``.
    """
    worst_mean, worst_max = 0.0, 0.0
    for i, engine in enumerate(engine_prompt_logprobs(engines, probes)):
        mean, peak = logprob_gap(engine, trainer_logprobs)
        if mean > tolerance:
            raise WeightSyncError(f"engine {engines.urls[i]} disagrees with the trainer after the weight sync: "
                                  f"mean |logprob diff| {mean:.3g} > tolerance {tolerance:g} (max {peak:.3g})")
        worst_mean, worst_max = max(worst_mean, mean), max(worst_max, peak)
    return {"weight_sync/verify_logprob_diff_mean": worst_mean, "weight_sync/verify_logprob_diff_max": worst_max}
