"""The driver's weight-sync stage: every trainer rank runs :class:`megarl.weight_sync.sync.WeightSynchronizer`.

Ordering (done by the synchronizer's coordinator, trainer rank 0): pause generation on every
engine -> push the resharded buckets -> flush the prefix caches -> set the engines'
``weight_version`` to the new policy version -> continue generation. Then, per
``weight_sync.verify`` (``first``: the first sync and the first that changed the weights,
:func:`verify_now`; ``always``), the engines' teacher-forced logprobs on a few probe
sequences are compared with the trainer's (SGLang reports success even for tensors it ignored, so
the only proof of a sync is the engines' output), and the engines' ``weight_version`` is read
back so the log shows it advancing.

With ``train.routing_replay: r3`` the trainer's forward replays routes and refuses a batch without
them, while the engines route freely: the probes then carry the routes the first engine chose for
them (:func:`probe_routes`, asked after the sync), so the trainer replays exactly what the engine
did and every other difference (a q/k/v layout error that keeps shapes) still shows in the logprobs.
"""
from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from megarl.training.batch import TrainBatch

logger = logging.getLogger("megarl.train")

NUM_PROBES = 2
PROBE_TOKENS = 48


def probe_batch(run: Any) -> TrainBatch:
    """A few training prompts (raw text tokens, at most ``PROBE_TOKENS`` each) as a batch."""
    from transformers import AutoTokenizer

    cfg = run.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    seqs = [tokenizer.encode(run.dataset.prompt(i), add_special_tokens=False)[:PROBE_TOKENS]
            for i in range(min(NUM_PROBES, len(run.dataset)))]
    seqs = [s for s in seqs if len(s) >= 2] or [[0, 1]]
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    return TrainBatch(input_ids=torch.tensor([t for s in seqs for t in s], dtype=torch.int64), cu_seqlens=cu,
                      loss_mask=torch.zeros(total, dtype=torch.bool), advantages=torch.zeros(len(seqs)),
                      rollout_logprobs=torch.zeros(total))


def probe_routes(engine_url: str, probes: TrainBatch) -> torch.Tensor:
    """The experts the engine at ``engine_url`` routes each probe token to (R3 verification).

    One request per probe (one new token, greedy): SGLang returns the routes of every prompt
    position (``[P + 1 - 1, L, K]``: the new token is never forwarded).

    Args:
        engine_url: an engine launched with ``--enable-return-routed-experts`` (R3 runs are).
        probes: the probe batch (``input_ids [T_total]``, ``cu_seqlens [N + 1]``).

    Returns:
        ``[T_total, L, K]`` int32 HF expert ids, the probes' tokens in order.

    Raises:
        megarl.rollout.client.EngineRequestError: the engine returned no routes.
    """
    from megarl.weight_sync.engine_clients import EngineClients

    cu = probes.cu_seqlens.tolist()
    rows = []
    with EngineClients([engine_url]) as engine:
        for start, end in zip(cu[:-1], cu[1:]):
            out = engine.call_all("generate", probes.input_ids[start:end].tolist(),
                                  {"max_new_tokens": 1, "temperature": 0.0}, return_routed_experts=True,
                                  return_logprob=False)[0]
            rows.append(out.routed_experts[:end - start].to(torch.int32))
    return torch.cat(rows)


def engines_serve_block_fp8(cfg: Any) -> bool:
    """Whether the engines serve a block-FP8 checkpoint: ``model.hf_path``'s ``quantization_config``
    (the directory every engine serves, ``megarl.rollout.engine_view`` keeps that config).

    Raises:
        ValueError: a ``quantization_config`` megarl cannot serve (names the field).
    """
    from megarl.models.fp8_blocks import parse_quantization_config
    from megarl.training.model import load_hf_config

    hf_config = load_hf_config(str(cfg.model.hf_path))
    return parse_quantization_config(getattr(hf_config, "quantization_config", None),
                                     where=f"{cfg.model.hf_path}/config.json quantization_config") is not None


def connect(run: Any) -> None:
    """Build the synchronizers on every trainer rank (after the engines are up, or restarted);
    resets what ``verify: first`` has checked (``run.synced_once``, ``run.verified_changed``)."""
    directory = str(run.run_dir / "weight_sync")
    run.trainer.close_weight_sync()
    run.trainer.connect_weight_sync(run.engine_urls, directory)
    run.synced_once = False
    run.verified_changed = False  # a restarted engine serves its checkpoint's weights again


def verify_now(verify: str, *, first_sync: bool, changed: bool, verified_changed: bool) -> bool:
    """Whether this sync is checked against the trainer (``weight_sync.verify``).

    ``always``: every sync. ``first``: the first sync of a connection (the trainer's weights equal
    the engines' checkpoint: conversion and loading agree) and the first one that changed the
    weights since (after a training step, or SFT before RL): a tensor the engines never loaded
    keeps its old value, which the unchanged first sync cannot tell from a loaded one.
    ``off``: never.

    Args:
        verify: ``off``, ``first`` or ``always``.
        first_sync: no sync since the engines were connected.
        changed: the weights pushed differ from those the engines held before (a newer policy
            version than the last sync's; at a connection's first sync, after SFT or a resume).
        verified_changed: a sync that changed the weights was checked since the connection.
    """
    if verify == "always":
        return True
    return verify == "first" and (first_sync or (changed and not verified_changed))


def load_proof_now(load_proof: str, verify: bool) -> bool:
    """Whether this sync's ``p2p`` buckets are read back by the engines (``weight_sync.load_proof``:
    ``every_sync``, ``verified_syncs``: those :func:`verify_now` checks, ``off``)."""
    if load_proof not in ("every_sync", "verified_syncs", "off"):
        raise ValueError(f"weight_sync.load_proof must be every_sync | verified_syncs | off, got {load_proof!r}")
    return load_proof == "every_sync" or (load_proof == "verified_syncs" and verify)


def verifies(run: Any, version: int) -> bool:
    """Whether the sync of policy ``version`` about to run is verified (:func:`verify_now` on the
    run's state; records a verified sync that changed the weights in ``run.verified_changed``).
    The engines hold their checkpoint before a connection's first sync (changed after SFT or a
    resume: ``version > 0``), else the last sync's version (``run.synced_version``)."""
    first = not run.synced_once
    changed = (run.trained_before_rl or version > 0) if first else version != run.synced_version
    verify = verify_now(run.cfg.weight_sync.verify, first_sync=first, changed=changed,
                        verified_changed=run.verified_changed)
    run.verified_changed = run.verified_changed or (verify and changed)
    return verify


def sync_engines(run: Any, version: int) -> dict[str, float]:
    """One weight sync to every engine at policy ``version`` (module docstring); its metrics."""
    cfg = run.cfg
    if not run.sync_connected:
        connect(run)
        run.sync_connected = True
    verify = verifies(run, version)
    metrics = dict(run.trainer.sync_weights(version, load_proof_now(cfg.weight_sync.load_proof, verify)))
    if verify:
        if run.probes is None:
            run.probes = probe_batch(run)
        probes = run.probes
        if cfg.train.routing_replay == "r3":  # the trainer replays the engine's routes (module docstring)
            probes = probes.replace(routed_experts=probe_routes(run.engine_urls[0], probes))
        from megarl.training.fp8 import verify_tolerance

        # FP8 trainer GEMMs, block-FP8 engine weights: the tolerance covers each quantisation present.
        tolerance = verify_tolerance(cfg.train, float(cfg.weight_sync.verify_tolerance),
                                     engine_block_fp8=engines_serve_block_fp8(cfg))
        results = run.trainer.verify_weights(probes, tolerance)
        metrics.update(next((r for r in results if r), {}))
    run.synced_once = True
    versions = ray.get(run.rollout.weight_versions.remote(), timeout=120)
    numeric = [int(v) for v in versions.values() if v is not None and str(v).isdigit()]
    if numeric:
        metrics["engine/weight_version"] = run.engine_weight_version = float(min(numeric))
    if any(str(v) != str(version) for v in versions.values()):
        logger.warning("engines report weight versions %s after syncing version %d", versions, version)
    diff = metrics.get("weight_sync/verify_logprob_diff_mean")
    logger.info("weight sync -> policy version %d: engines %s, %.2fs%s", version,
                ", ".join(f"{k}@{v}" for k, v in versions.items()), metrics.get("timing/weight_sync_s", float("nan")),
                f", logprob mismatch after sync {diff:.2e}" if diff is not None else "")
    return metrics
