"""The wiring of one training run: its processes, and the stages the RL loop calls.

Build order (:meth:`Run.build`): run directory and resolved config -> data (bad data fails here,
before Ray) -> the checkpoint to resume, or the SFT demonstrations -> metric sinks -> Ray and
placement groups -> engines start (in the background) -> trainer ranks -> engines ready -> rollout
actor -> the stages -> resume from the checkpoint, or SFT cold start -> the first weight sync
(engines serve the launch weights: the trainer's are pushed, also when they are the same, so the
first sync is verified before any rollout).

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
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf

from megarl.cluster.bundles import bundle_shapes
from megarl.cluster.colocated import EngineMemoryLoan, lends_engine_memory
from megarl.cluster.placement import Placement, build_placement, init_ray
from megarl.cluster.ray_engines import EngineGroup
from megarl.cluster.retrieval import start_retrieval, stop_retrieval
from megarl.config.schema import DataConfig, MegarlConfig
from megarl.data.datasets import PromptDataset
from megarl.launch.metric_sinks import MetricsLogger
from megarl.launch.rollout_actor import RolloutWorker
from megarl.launch.run_state import find_resume
from megarl.launch.stages import Stages, Started, build_stages
from megarl.launch.trainer_group import TrainerGroup

logger = logging.getLogger("megarl.train")


def prepare_run_dir(cfg: MegarlConfig) -> Path:
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


def trainer_config(cfg: MegarlConfig, *, resuming: bool) -> MegarlConfig:
    """The config the trainer ranks are built from: ``cfg``, or, when a checkpoint is resumed, a
    copy without ``model.load_dir`` (resume wins: the checkpoint's weights replace the start weights,
    so reading ``load_dir`` would only cost time)."""
    if not resuming or not cfg.model.load_dir:
        return cfg
    logger.info("resuming: model.load_dir %s is not read", cfg.model.load_dir)
    trainer_cfg = copy.deepcopy(cfg)
    trainer_cfg.model.load_dir = None
    return trainer_cfg


def load_datasets(data: DataConfig) -> tuple[PromptDataset, list[dict] | None]:
    """Training prompts and (when ``data.eval_path`` is set) the held-out evaluation rows.

    Raises:
        megarl.data.datasets.DatasetError: unreadable file or missing fields (names the file/row).
    """
    kwargs = dict(data.dataset_kwargs or {})
    train = PromptDataset.from_file(data.train_path, prompt_key=data.prompt_key, answer_key=data.answer_key,
                                    dataset=data.dataset, dataset_kwargs=kwargs)
    eval_rows = None
    if data.eval_path:
        held = PromptDataset.from_file(data.eval_path, prompt_key=data.prompt_key, answer_key=data.answer_key,
                                       max_rows=data.max_eval_samples, dataset=data.dataset, dataset_kwargs=kwargs)
        eval_rows = held.rows
    return train, eval_rows


def _plain_config(cfg: MegarlConfig) -> dict[str, Any]:
    """``cfg`` resolved into plain dicts and lists (the metric sinks' copy of the run config)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(plain, dict):
        raise TypeError(f"the run config is a {type(plain).__name__}, not a mapping")
    return {str(key): value for key, value in plain.items()}


@dataclasses.dataclass
class Run:
    """A run's processes and its :class:`Stages` (see the module docstring): ``Run(prepare_run_dir(cfg))``,
    then :meth:`build`; :meth:`close` stops what it started, also after a failed build."""

    run_dir: Path
    stages: Stages | None = None
    started_ray: bool = False
    placement: Placement | None = None
    engines: EngineGroup | None = None
    engine_urls: list[str] = dataclasses.field(default_factory=list)
    loan: EngineMemoryLoan | None = None
    """Colocated: the engines' memory lent to the trainer (:mod:`megarl.cluster.colocated`)."""
    trainer: TrainerGroup | None = None
    rollout_actor: Any = None
    retrieval: Any = None
    """The retrieval service's actor (``retrieval.index`` set), or None."""
    metrics: MetricsLogger | None = None

    def build(self, cfg: MegarlConfig) -> Stages:
        """Start every process and build the stages (the module docstring's order); returns them
        (also kept as :attr:`stages`). On failure, :meth:`close` stops what was started.

        Everything that can fail without a process (data, checkpoint state, SFT demonstrations,
        metric sinks) is done before Ray starts.
        """
        from megarl.launch.sft import prepare_demonstrations, run_cold_start

        dataset, eval_rows = load_datasets(cfg.data)
        resume_from, state = find_resume(cfg.checkpoint, self.run_dir)
        cold_start = prepare_demonstrations(cfg, dataset) if resume_from is None else None
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, jsonl=cfg.logging.jsonl,
                                     wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                                     config=_plain_config(cfg), wandb_id=state.wandb_id)
        state.wandb_id = self.metrics.wandb_id
        self._start_processes(cfg, resuming=resume_from is not None)
        started = self._started()
        stages = build_stages(cfg, started, dataset, eval_rows, state)
        if resume_from is not None:
            stages.checkpoint.restore(resume_from)
        else:
            stages.sync.trained_before_rl = run_cold_start(started.trainer, cold_start, run_dir=self.run_dir)
        started.loan.resume()  # colocated: lent while the trainer was built (module docstring)
        stages.sync.push(stages.train.policy_version)
        self.stages = stages
        return stages

    def _start_processes(self, cfg: MegarlConfig, *, resuming: bool = False) -> None:
        """Ray, placement groups, engines, trainer ranks, rollout actor (the module docstring's order)."""
        from megarl.logging_setup import link_ray_logs
        from megarl.weight_sync.choice import engine_custom_weight_loaders, run_transport

        trainer_cfg = trainer_config(cfg, resuming=resuming)
        shapes = bundle_shapes(cfg)  # devices resolved once; the engines and ranks read them off the placement
        self.started_ray = init_ray(cfg, cuda=shapes.cuda)
        link_ray_logs(self.run_dir)  # run_dir/ray_logs -> this Ray session's worker logs
        placement = self.placement = build_placement(cfg, shapes)
        # Engines boot (tens of seconds) while the trainer ranks build their models.
        loaders = engine_custom_weight_loaders(run_transport(cfg, cuda=shapes.cuda))
        self.engines = EngineGroup(cfg, placement, cfg.model.hf_path, self.run_dir,
                                   custom_weight_loaders=loaders)
        self.retrieval = start_retrieval(cfg, self.run_dir)  # sets rollout.tools.search.url
        self.loan = EngineMemoryLoan(lends=lends_engine_memory(cfg.cluster, cfg.rollout),
                                     weights_each_step=int(cfg.weight_sync.every_n_steps) == 1)
        if self.loan.lends:
            # Colocated: the engines free their GPUs before the trainer is built on them (their
            # weights too: the first weight sync rewrites every one); resumed before that sync.
            self.engine_urls = self.loan.engine_urls = self.engines.wait_ready()
            self.loan.release(weights=True)
        self.trainer = self.loan.trainer = TrainerGroup(trainer_cfg, placement)
        if not self.loan.lends:
            self.engine_urls = self.loan.engine_urls = self.engines.wait_ready()
        self.rollout_actor = RolloutWorker.options(num_cpus=0).remote(  # type: ignore[attr-defined]  # a Ray actor class
            OmegaConf.to_yaml(cfg, resolve=True), self.engine_urls, self.engines.ids)

    def _started(self) -> Started:
        """What :meth:`_start_processes` started, for :func:`~megarl.launch.stages.build_stages`.

        Raises:
            RuntimeError: called before :meth:`_start_processes` (or after :meth:`close`).
        """
        if (self.engines is None or self.loan is None or self.trainer is None or self.placement is None
                or self.metrics is None):
            raise RuntimeError("Run: the engines, loan and trainer are used before _start_processes() "
                               "started them (or after close())")
        return Started(run_dir=self.run_dir, engines=self.engines, engine_urls=self.engine_urls, loan=self.loan,
                       trainer=self.trainer, rollout_actor=self.rollout_actor, metrics=self.metrics,
                       on_cuda=self.placement.cuda)

    def close(self) -> None:
        """Stop everything this run started (idempotent, best effort); an HF export in flight is
        finished first (its error, already logged, is not raised here: see
        :meth:`~megarl.launch.checkpoint_stage.CheckpointStage.wait_for_export`)."""
        if self.stages is not None:
            self.stages.checkpoint.hf_export.wait(raise_error=False)
            self.stages.log.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.rollout_actor is not None:
            try:
                ray.get(self.rollout_actor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - teardown
                pass
            ray.kill(self.rollout_actor, no_restart=True)
            self.rollout_actor = None
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
