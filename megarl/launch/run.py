"""Everything one training run holds, built in order, and the operations the driver loop calls.

Build order (:meth:`Run.build`): run directory and resolved config -> data (bad data fails here,
before Ray) -> Ray and placement groups -> engines start (in the background) -> trainer ranks ->
engines ready -> rollout actor -> resume from the newest checkpoint, or SFT cold start -> weights
pushed to the engines when they differ from the launch weights -> evaluation before training.

Colocated (synchronous, launched engines): the trainer shares the engines' GPUs, so it is built in
the memory they lend it: engines ready -> engine memory released (weights, KV cache, CUDA graphs)
-> trainer ranks -> resume or SFT -> engine memory resumed -> the first weight sync (it rewrites
the released weights). Engines and trainer are then never both built at full size on one GPU.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf

from megarl.cluster.engines import EngineGroup
from megarl.cluster.placement import build_placement, init_ray
from megarl.cluster.retrieval import start_retrieval, stop_retrieval
from megarl.data.datasets import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.launch import run_state as rs
from megarl.launch.hf_export import BackgroundExport
from megarl.launch.metrics import MetricsLogger
from megarl.launch.rollout_actor import RolloutWorker
from megarl.launch.route_files import write_routes
from megarl.launch.trainer_group import TrainerGroup

logger = logging.getLogger("megarl.train")


def prepare_run_dir(cfg: Any) -> Path:
    """Create ``logging.run_dir``; a fresh (non-resume) run never appends to an old run's files:
    a non-empty directory is renamed to ``<run_dir>.<timestamp>`` first (nothing is deleted)."""
    run_dir = Path(cfg.logging.run_dir)
    if run_dir.is_dir() and any(run_dir.iterdir()) and not cfg.checkpoint.resume:
        moved = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(moved)
        logger.warning("%s held an earlier run; moved it to %s (use checkpoint.resume=true to continue it)",
                       run_dir, moved)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    return run_dir


def load_datasets(cfg: Any) -> tuple[PromptDataset, list[dict] | None]:
    """Training prompts and (when ``data.eval_path`` is set) the held-out evaluation rows.

    Raises:
        megarl.data.datasets.DatasetError: unreadable file or missing fields (names the file/row).
    """
    data = cfg.data
    reader = dict(dataset=data.dataset, dataset_kwargs=dict(data.dataset_kwargs or {}))
    train = PromptDataset.from_file(data.train_path, prompt_key=data.prompt_key, answer_key=data.answer_key, **reader)
    eval_rows = None
    if data.eval_path:
        held = PromptDataset.from_file(data.eval_path, prompt_key=data.prompt_key, answer_key=data.answer_key,
                                       max_rows=data.max_eval_samples, **reader)
        eval_rows = held.rows
    return train, eval_rows


def save_dir_of(cfg: Any, run_dir: Path) -> Path:
    """``checkpoint.save_dir`` or ``{run_dir}/checkpoints``."""
    return Path(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else run_dir / "checkpoints"


def trainer_config(cfg: Any, *, resuming: bool) -> Any:
    """The config the trainer ranks are built from: ``cfg``, or, when a checkpoint is resumed, a
    copy without ``model.load_dir`` (resume wins: the checkpoint's weights replace the start weights,
    so reading ``load_dir`` would only cost time)."""
    if not resuming or not cfg.model.load_dir:
        return cfg
    logger.info("resuming: model.load_dir %s is not read", cfg.model.load_dir)
    trainer_cfg = copy.deepcopy(cfg)
    trainer_cfg.model.load_dir = None
    return trainer_cfg


@dataclasses.dataclass
class PendingRollout:
    """One step's rollout, in flight (a Ray reference) or finished, with the prompts it started from
    (a failed rollout is generated again from the same rows, hence with the same sampling seeds)."""

    step: int
    rows: list[dict]
    result: Any
    policy_version: int = 0
    """The engines' weight version when the rollout started."""

    def wait(self) -> Any:
        """The :class:`~megarl.rollout.manager.RolloutBatch` (blocks while in flight)."""
        if isinstance(self.result, ray.ObjectRef):
            self.result = ray.get(self.result)
        return self.result


@dataclasses.dataclass
class Run:
    """The live parts of a run (see the module docstring). Build with :meth:`build`."""

    cfg: Any
    run_dir: Path
    dataset: PromptDataset
    eval_rows: list[dict] | None
    sampler: ResumableSampler
    state: rs.RunState
    started_ray: bool = False
    placement: Any = None
    trainer: TrainerGroup | None = None
    engines: EngineGroup | None = None
    rollout: Any = None
    retrieval: Any = None
    """The retrieval service's actor (``retrieval.index`` set), or None."""
    metrics: MetricsLogger | None = None
    engine_urls: list[str] = dataclasses.field(default_factory=list)
    trained_before_rl: bool = False
    """SFT ran: the trainer's weights differ from the engines' launch weights."""
    sync_connected: bool = False
    synced_once: bool = False
    probes: Any = None
    """Weight-sync verification sequences (built on first use)."""
    engine_weight_version: float = float("nan")
    """The engines' weight version after the last sync."""
    engine_memory_released: tuple[str, ...] = ()
    """Colocated: the SGLang memory tags the engines lent to the trainer (:mod:`megarl.cluster.colocated`)."""
    synced_version: int | None = None
    """The policy version last pushed to the engines (None before the first sync)."""
    hf_export: BackgroundExport = dataclasses.field(default_factory=BackgroundExport)
    """The HF export in flight (``checkpoint.hf_export_interval``)."""

    @classmethod
    def build(cls, cfg: Any) -> Run:
        """Build every part; on failure, everything started so far is shut down and the error raised.

        Everything that can fail without a process (data, checkpoint state, SFT demonstrations,
        metric sinks) is done before Ray starts.
        """
        from megarl.launch.sft import prepare_demonstrations, run_cold_start
        from megarl.plugins import import_plugins

        import_plugins(cfg.plugins)  # user datasets, before the data is read
        run_dir = prepare_run_dir(cfg)
        dataset, eval_rows = load_datasets(cfg)
        sampler = ResumableSampler(len(dataset), seed=int(cfg.train.seed), shuffle=bool(cfg.data.shuffle))
        latest = rs.find_latest(save_dir_of(cfg, run_dir)) if cfg.checkpoint.resume else None
        state = rs.load_driver_state(latest) if latest is not None else rs.RunState()
        demos = prepare_demonstrations(cfg, dataset) if latest is None else []
        run = cls(cfg, run_dir, dataset, eval_rows, sampler, state)
        run.metrics = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, jsonl=cfg.logging.jsonl,
                                    wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                                    config=OmegaConf.to_container(cfg, resolve=True), wandb_id=state.wandb_id)
        state.wandb_id = run.metrics.wandb_id
        try:
            run._start_processes(resuming=latest is not None)
            if latest is not None:
                run.restore(latest)
            else:
                run.trained_before_rl = run_cold_start(run, demos)
            run.resume_engine_memory()  # colocated: lent while the trainer was built (module docstring)
            # Engines serve the launch weights: push the trainer's (also when they are the same, so
            # the first sync is verified before any rollout).
            run.sync_weights(run.state.policy_version)
        except BaseException:
            run.close()
            raise
        return run

    def _start_processes(self, *, resuming: bool = False) -> None:
        cfg = self.cfg
        self.started_ray = init_ray(cfg)
        from megarl.logging_setup import link_ray_logs

        link_ray_logs(self.run_dir)  # run_dir/ray_logs -> this Ray session's worker logs
        self.placement = build_placement(cfg)
        # Engines boot (tens of seconds) while the trainer ranks build their models.
        from megarl.weight_sync.choice import engine_custom_weight_loaders, run_transport

        self.engines = EngineGroup(cfg, self.placement, cfg.model.hf_path, self.run_dir,
                                   custom_weight_loaders=engine_custom_weight_loaders(run_transport(cfg)))
        self.retrieval = start_retrieval(cfg, self.run_dir)  # sets rollout.tools.search.url
        if self._lends_engine_memory():
            # Colocated: the engines free their GPUs before the trainer is built on them (their
            # weights too: the first weight sync rewrites every one); resumed before that sync.
            self.engine_urls = self.engines.wait_ready()
            self.release_engine_memory(weights=True)
            self.trainer = TrainerGroup(trainer_config(cfg, resuming=resuming), self.placement)
        else:
            self.trainer = TrainerGroup(trainer_config(cfg, resuming=resuming), self.placement)
            self.engine_urls = self.engines.wait_ready()
        self.rollout = RolloutWorker.options(num_cpus=0).remote(
            OmegaConf.to_yaml(cfg, resolve=True), self.engine_urls, self.engines.ids)

    def restore(self, ckpt: Path) -> None:
        """Load the trainer and driver state of checkpoint ``ckpt``."""
        logger.info("resuming from %s", ckpt)
        self.trainer.load_checkpoint(str(ckpt / rs.TRAINER_DIR))
        self.sampler.load_state_dict(self.state.sampler)
        rs.restore_rng(self.state.rng)
        logger.info("resumed at step %d, policy version %d", self.state.step, self.state.policy_version)

    # ------------------------------------------------------------------ per-step operations
    def next_prompts(self) -> list[dict]:
        """The rows of the next step (``num_prompts_per_step + over_sample_prompts``)."""
        ro = self.cfg.rollout
        return [self.dataset[i] for i in self.sampler.next_indices(ro.num_prompts_per_step + ro.over_sample_prompts)]

    def start_rollout(self, step: int, rows: list[dict] | None = None) -> PendingRollout:
        """Start step ``step``'s rollout on the rollout actor (on the next prompts, or ``rows``).

        The rollout starts at the engines' weight version (the last synced one: with
        ``weight_sync.every_n_steps > 1`` it may be older than the trainer's policy version).
        """
        rows = self.next_prompts() if rows is None else rows
        version = self.synced_version if self.synced_version is not None else self.state.policy_version
        return PendingRollout(step, rows, self.rollout.generate.remote(rows, step, version), version)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine: pause -> push -> flush -> weight_version -> continue.

        Returns:
            ``weight_sync/*`` metrics and ``engine/weight_version``.
        """
        from megarl.launch.weight_sync_step import sync_engines

        metrics = sync_engines(self, version)
        self.synced_version = version
        return metrics

    def _lends_engine_memory(self) -> bool:
        """Colocated, synchronous, launched engines: they lend their GPU memory to the trainer."""
        rollout = self.cfg.rollout
        return self.cfg.cluster.placement == "colocated" and not (rollout.async_mode or rollout.external_engine_urls)

    def release_engine_memory(self, *, weights: bool | None = None) -> None:
        """Colocated, synchronous: the engines (idle: before the first rollout, or after the step's
        rollout) free their GPU memory for the trainer until :meth:`resume_engine_memory`
        (:mod:`megarl.cluster.colocated`).

        Args:
            weights: release the weights too (they come back uninitialised: only when the next weight
                sync rewrites them); None: when every step ends with a sync (``weight_sync.every_n_steps``).
        """
        from megarl.cluster import colocated

        if not self._lends_engine_memory():
            return
        if weights is None:
            weights = int(self.cfg.weight_sync.every_n_steps) == 1
        self.engine_memory_released = colocated.release(self.engine_urls, weights=weights, trainer=self.trainer)

    def resume_engine_memory(self) -> None:
        """Give the engines their memory back (weights, then KV cache and CUDA graphs); no-op if not lent."""
        from megarl.cluster import colocated

        if self.engine_memory_released:
            colocated.resume(self.engine_urls, self.engine_memory_released, trainer=self.trainer)
            self.engine_memory_released = ()

    def heal_engines(self) -> list[str]:
        """Put every engine back into service: one the router took out of service although it still
        answers (a dropped connection while it was paused or busy) returns once it reports the
        synced policy version (weight syncs address every engine, in service or not); one that does
        not answer, or reports another version, is restarted, re-synced and then put back.

        Returns:
            The ids of the engines put back (restarted or re-admitted; a warning each).

        Raises:
            RuntimeError: a restarted, re-synced engine does not report the synced version.
        """
        from megarl.launch import weight_sync_step

        self.engines.stop_broken()  # an engine over several nodes with a part down is down as a whole
        health = ray.get(self.rollout.engine_health.remote(), timeout=120)
        dead = [eid for eid, ok in health.items() if not ok]
        readmitted = []
        for eid in ray.get(self.rollout.out_of_service.remote(), timeout=60):
            if eid in dead:
                continue
            if ray.get(self.rollout.set_alive.remote(eid, str(self.synced_version)), timeout=60):
                logger.warning("%s was out of service but answers and reports policy version %d; back in "
                               "service", eid, self.synced_version)
                readmitted.append(eid)
            else:
                dead.append(eid)
        if not dead:
            return readmitted
        for eid in dead:
            logger.warning("%s stopped answering; its requests were re-routed to the live engines. "
                           "Restarting it", eid)
            self.engines.restart(self.engines.ids.index(eid))
        weight_sync_step.connect(self)  # the old update groups included the dead engines
        self.sync_weights(self.state.policy_version)
        for eid in dead:
            if not ray.get(self.rollout.set_alive.remote(eid, str(self.synced_version)), timeout=60):
                raise RuntimeError(f"{eid} was restarted and re-synced but does not report weight version "
                                   f"{self.synced_version}; it would serve other weights than the policy's")
            logger.warning("%s restarted and re-synced to policy version %d; back in service", eid, self.synced_version)
        return readmitted + dead

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out rows (empty when there are none)."""
        if not self.eval_rows:
            return {}
        metrics, sample = ray.get(self.rollout.evaluate.remote(self.eval_rows, self.state.policy_version))
        logger.info("eval sample: %s", sample)
        return metrics

    def save_checkpoint(self, pending: Sequence[PendingRollout] = ()) -> Path:
        """Save trainer (every rank) and driver state as ``step_{state.step}``; then mark it complete.

        Async mode: the rollouts in flight (``pending``, oldest first) are waited for and saved with
        the driver state, so a resumed run trains on exactly the same trajectories.
        """
        save_dir = save_dir_of(self.cfg, self.run_dir)
        ckpt = rs.step_dir(save_dir, self.state.step)
        start = time.perf_counter()
        self.trainer.save_checkpoint(str(ckpt / rs.TRAINER_DIR))
        model = self.cfg.model  # HF config and tokenizer into the checkpoint (unset in stand-in runs)
        rs.save_hf_metadata(ckpt, None if OmegaConf.is_missing(model, "hf_path") else model.hf_path,
                            model.tokenizer_path)
        self.state.sampler = self.sampler.state_dict()
        self.state.rng = rs.capture_rng()
        self.state.pending_rollouts = []
        for k, item in enumerate(pending):  # async: the in-flight rollouts are finished and saved with the state
            batch = item.wait()
            # R3 routes: references die with the session -> files, one task per group (route_files.py)
            self.state.pending_rollouts.append({"step": item.step, "rows": item.rows,
                                                "groups": write_routes(batch.groups, ckpt, f"p{k}"),
                                                "metrics": dict(batch.metrics),
                                                "policy_version": item.policy_version})
        rs.save_driver_state(ckpt, self.state, OmegaConf.to_yaml(self.cfg, resolve=True))
        export_error = self.hf_export.wait(raise_error=False)  # the rotation below may delete what it reads
        rs.commit_checkpoint(save_dir, ckpt, int(self.cfg.checkpoint.keep_last))
        logger.info("checkpoint %s saved in %.1fs", ckpt, time.perf_counter() - start)
        if export_error is not None:  # logged and counted by the export; training goes on (hf_export.py)
            logger.error("HF export failed (%d so far): %r; training goes on", len(self.hf_export.failures),
                         export_error)
        every = int(self.cfg.checkpoint.hf_export_interval)
        if every > 0 and self.state.step % every == 0:
            self.export_hf(ckpt)
        return ckpt

    def export_hf(self, ckpt: Path) -> Path:
        """Start converting the checkpoint's trainer weights to a Hugging Face directory
        ``{run_dir}/hf/step_*`` in the background (:mod:`megarl.launch.hf_export`: the loop goes on);
        returns that directory. :meth:`wait_for_export` waits for it."""
        out = self.run_dir / "hf" / ckpt.name
        self.hf_export.start(ckpt, out)
        return out

    def wait_for_export(self) -> None:
        """Block until the HF export in flight (if any) is written; raise its error."""
        self.hf_export.wait()

    def close(self) -> None:
        """Stop everything this run started (idempotent, best effort); an HF export in flight is
        finished first (its error, already logged, is not raised here: see :meth:`wait_for_export`)."""
        self.hf_export.wait(raise_error=False)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.rollout is not None:
            try:
                ray.get(self.rollout.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - teardown
                pass
            ray.kill(self.rollout, no_restart=True)
            self.rollout = None
        stop_retrieval(self.retrieval)
        self.retrieval = None
        if self.trainer is not None:
            try:
                self.trainer.close_weight_sync(timeout_s=60)
            except Exception:  # noqa: BLE001 - teardown; the group may already be dead
                pass
            self.trainer.shutdown()
            self.trainer = None
        if self.engines is not None:
            self.engines.shutdown()
            self.engines = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
