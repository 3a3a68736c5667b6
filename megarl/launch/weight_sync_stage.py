"""The weight-sync stage of the RL loop (:class:`WeightSyncStage`): every trainer rank runs
:class:`megarl.weight_sync.sync.WeightSynchronizer`.

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

import dataclasses
import logging
from pathlib import Path
from typing import Any

import ray
import torch

from megarl.config.schema import ModelConfig, TrainConfig, WeightSyncConfig
from megarl.training.batch import TrainBatch

logger = logging.getLogger("megarl.train")

NUM_PROBES = 2
PROBE_TOKENS = 48


def probe_batch(tokenizer_path: str, prompts: list[str]) -> TrainBatch:
    """``prompts`` (raw text tokens, at most ``PROBE_TOKENS`` each) as a batch (``[0, 1]`` where none
    has two tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    seqs = [tokenizer.encode(p, add_special_tokens=False)[:PROBE_TOKENS] for p in prompts]
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


def engines_serve_block_fp8(model: ModelConfig) -> bool:
    """Whether the engines serve a block-FP8 checkpoint: ``model.hf_path``'s ``quantization_config``
    (the directory every engine serves, ``megarl.rollout.engine_view`` keeps that config).

    Raises:
        ValueError: a ``quantization_config`` megarl cannot serve (names the field).
    """
    from megarl.models.fp8_blocks import parse_quantization_config
    from megarl.training.model import load_hf_config

    hf_config = load_hf_config(str(model.hf_path))
    return parse_quantization_config(getattr(hf_config, "quantization_config", None),
                                     where=f"{model.hf_path}/config.json quantization_config") is not None


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


@dataclasses.dataclass
class WeightSyncStage:
    """Pushes the trainer's weights to every engine (module docstring) and holds what that needs to
    remember: whether the synchronizers are connected, what ``verify: first`` has checked, the probe
    batch, the version last pushed and the one the engines report."""

    cfg: WeightSyncConfig
    """The ``weight_sync`` section (``verify``, ``load_proof``, ``verify_tolerance``, ``every_n_steps``)."""
    train_cfg: TrainConfig
    """The ``train`` section (``routing_replay``; its FP8 recipe widens the tolerance)."""
    model: ModelConfig
    """The ``model`` section (the tokenizer of the probes; the engines' checkpoint)."""
    trainer: Any
    """The :class:`~megarl.launch.trainer_group.TrainerGroup`."""
    engine_urls: list[str]
    """Every engine, in engine order."""
    rollout_actor: Any
    """The :class:`~megarl.launch.rollout_actor.RolloutWorker` handle (it reads the engines'
    ``weight_version``)."""
    directory: Path
    """The synchronizers' shared directory (``{run_dir}/weight_sync``)."""
    probe_prompts: list[str]
    """A few training prompts: the verification probes (tokenised on first use)."""
    connected: bool = False
    """The synchronizers are built on every trainer rank."""
    synced_once: bool = False
    """A sync ran since the synchronizers were connected."""
    verified_changed: bool = False
    """A verified sync changed the engines' weights since the connection."""
    trained_before_rl: bool = False
    """SFT ran: the trainer's weights differ from the engines' launch weights."""
    probes: TrainBatch | None = None
    """The probe batch (built on first use)."""
    synced_version: int | None = None
    """The policy version last pushed to the engines (None before the first sync)."""
    engine_weight_version: float = float("nan")
    """The engines' (lowest) reported weight version after the last sync."""

    @property
    def every_n_steps(self) -> int:
        """``weight_sync.every_n_steps``: the engines are updated after every n-th optimizer step."""
        return int(self.cfg.every_n_steps)

    def connect(self) -> None:
        """Build the synchronizers on every trainer rank (after the engines are up, or restarted);
        resets what ``verify: first`` has checked."""
        self.trainer.close_weight_sync()
        self.trainer.connect_weight_sync(self.engine_urls, str(self.directory))
        self.connected = True
        self.synced_once = False
        self.verified_changed = False  # a restarted engine serves its checkpoint's weights again

    def resync(self, version: int) -> int:
        """Reconnect (engines were restarted: the old update groups included them) and push policy
        ``version``; returns it (:func:`megarl.cluster.ray_engines.heal_engines`)."""
        self.connect()
        self.push(version)
        return version

    def verifies(self, version: int) -> bool:
        """Whether the sync of policy ``version`` about to run is verified (:func:`verify_now`; records
        a verified sync that changed the weights). The engines hold their checkpoint before a
        connection's first sync (changed after SFT or a resume: ``version > 0``), else the last sync's
        version."""
        first = not self.synced_once
        changed = (self.trained_before_rl or version > 0) if first else version != self.synced_version
        verify = verify_now(self.cfg.verify, first_sync=first, changed=changed,
                            verified_changed=self.verified_changed)
        self.verified_changed = self.verified_changed or (verify and changed)
        return verify

    def push(self, version: int) -> dict[str, float]:
        """One weight sync to every engine at policy ``version`` (module docstring).

        Returns:
            ``weight_sync/*`` metrics, ``timing/weight_sync_s``, ``engine/weight_version``.

        Raises:
            RuntimeError: the engines' logprobs disagree with the trainer's after the sync (verified syncs).
        """
        if not self.connected:
            self.connect()
        verify = self.verifies(version)
        metrics = dict(self.trainer.sync_weights(version, load_proof_now(self.cfg.load_proof, verify)))
        if verify:
            metrics.update(self._verify())
        self.synced_once, self.synced_version = True, version
        versions = ray.get(self.rollout_actor.weight_versions.remote(), timeout=120)
        numeric = [int(v) for v in versions.values() if v is not None and str(v).isdigit()]
        if numeric:
            metrics["engine/weight_version"] = self.engine_weight_version = float(min(numeric))
        if any(str(v) != str(version) for v in versions.values()):
            logger.warning("engines report weight versions %s after syncing version %d", versions, version)
        diff = metrics.get("weight_sync/verify_logprob_diff_mean")
        logger.info("weight sync -> policy version %d: engines %s, %.2fs%s", version,
                    ", ".join(f"{k}@{v}" for k, v in versions.items()),
                    metrics.get("timing/weight_sync_s", float("nan")),
                    f", logprob mismatch after sync {diff:.2e}" if diff is not None else "")
        return metrics

    def _verify(self) -> dict[str, float]:
        """The engines' teacher-forced logprobs on the probes against the trainer's (module docstring)."""
        from megarl.training.fp8 import verify_tolerance

        # FP8 trainer GEMMs, block-FP8 engine weights: the tolerance covers each quantisation present.
        tolerance = verify_tolerance(self.train_cfg, float(self.cfg.verify_tolerance),
                                     engine_block_fp8=engines_serve_block_fp8(self.model))
        if self.probes is None:
            self.probes = probe_batch(self.model.tokenizer_path or self.model.hf_path, self.probe_prompts)
        probes = self.probes
        if self.train_cfg.routing_replay == "r3":  # the trainer replays the engine's routes (module docstring)
            probes = probes.replace(routed_experts=probe_routes(self.engine_urls[0], probes))
        results = self.trainer.verify_weights(probes, tolerance)
        return next((r for r in results if r), {})
