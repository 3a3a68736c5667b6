"""``megarl eval``: a checkpoint or HF model evaluated as the training run evaluates it.

    megarl eval CONFIG [overrides] (--checkpoint PATH | --hf PATH) [--data PATH] [--samples N]
        [--k 1,4,...] [--out REPORT.json]

1. **Model**: ``--hf`` (a directory or a hub id, :mod:`megarl.config.hub`) is served as it is. ``--checkpoint`` (a
   trainer's ``RUN/checkpoints/step_N``,
   its ``trainer/``, a ``checkpoints/`` directory with ``latest``, or any dist checkpoint of any
   layout) is exported to an HF directory by megarl's own converter
   (:func:`megarl.conversion.convert.megatron_to_hf_dir`, as ``megarl convert megatron-to-hf`` and
   the run's background exports do), unless the run already exported it to ``RUN/hf/step_N``.
2. **Config**: the recipe with ``model.hf_path`` set to that directory (validated first, against the
   checkpoint's stored ``hf_config/``, before anything is exported), ``data.eval_path`` from
   ``--data``, ``data.eval_samples_per_prompt`` from ``--samples`` (default: the recipe's; 1 when
   that is 0).
3. **Engines**: the run's own start-up: Ray, the placement of the ``cluster`` section, the
   ``rollout.num_engines`` engines (every one serves; the router spreads prompts over them), the
   retrieval service when the recipe has one, and the rollout actor with the recipe's agent loop,
   tools and reward. No trainer rank is started, and none is reserved: only the engines' devices
   (:func:`megarl.cluster.bundles.bundle_shapes` with ``engines_only``).
4. **Evaluation**: :meth:`~megarl.launch.rollout_actor.RolloutWorker.evaluate_records`, the
   function behind the training loop's held-out evaluation (``data.eval_interval``): the same rows
   (``data.max_eval_samples``), the greedy pass and the n sampled trajectories per prompt with the
   same seeds, so ``eval/accuracy`` and ``eval/sampled_*`` equal the run's at the checkpoint's step.
5. **Report** (:mod:`megarl.launch.eval_report`): pass@k (unbiased, Chen et al. 2021), mean
   reward, tool calls and errors per trajectory, response length, truncation rate, every
   trajectory's record; written to ``--out`` (default ``RUN/eval/step_N.json`` for a trainer
   checkpoint, else ``runs/eval/<the model's path, / as -->.json``) and printed as a table. Engine
   logs and the export go to the directory beside it with the report's name.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from megarl.config.schema import MegarlConfig, as_megarl_config
from megarl.errors import UserError

logger = logging.getLogger("megarl.eval")


class EvalArgumentError(UserError):
    """``megarl eval``'s arguments name no model, two models, a path that is not one, or bad counts."""


@dataclass(frozen=True)
class EvalRequest:
    """The checked command line."""

    checkpoint: Path | None
    """The dist checkpoint directory (resolved: ``step_N/trainer`` or a converted one), or None."""
    hf_dir: Path | None
    """The HF directory (``--hf``), or None."""
    out: Path
    samples: int | None
    """``--samples`` (None: the recipe's ``data.eval_samples_per_prompt``, 1 when that is 0)."""
    ks: tuple[int, ...] | None
    """``--k`` (None: 1, 2, 4, ... up to n, and n)."""

    def checkpoint_dir(self) -> Path:
        """:attr:`checkpoint`, of a request without ``--hf``.

        Raises:
            EvalArgumentError: the request names neither model (:func:`check_args` makes none such).
        """
        if self.checkpoint is None:
            raise EvalArgumentError("give exactly one model: --checkpoint RUN/checkpoints/step_N or --hf HF_DIR")
        return self.checkpoint

    @property
    def work_dir(self) -> Path:
        """Engine logs and the HF export: beside the report, named as it is."""
        return self.out.with_suffix("")


def _trainer_step_dir(ckpt: Path) -> Path | None:
    """``RUN/checkpoints/step_N`` of a trainer checkpoint (``ckpt`` is its ``trainer/``), else None."""
    return ckpt.parent if ckpt.name == "trainer" and ckpt.parent.name.startswith("step_") else None


def _resolve_checkpoint(path: str) -> Path:
    from megarl.conversion.convert import resolve_checkpoint_dir

    try:  # also a save_dir: its newest complete checkpoint
        return resolve_checkpoint_dir(path).resolve()
    except FileNotFoundError as e:
        raise EvalArgumentError(f"argument --checkpoint {path}: {e}") from e


def _parse_ks(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        ks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise EvalArgumentError(
            f"argument --k {text!r}: give comma-separated positive integers, e.g. --k 1,4,8") from None
    if not ks or ks[0] < 1:
        raise EvalArgumentError(f"argument --k {text!r}: give comma-separated positive integers, e.g. --k 1,4,8")
    return ks


def check_args(args: argparse.Namespace) -> EvalRequest:
    """The command line, checked before anything starts.

    Raises:
        EvalArgumentError: no model or two (``--checkpoint`` / ``--hf``), a path that is not a
            checkpoint or an HF directory, ``--data`` not a file, ``--samples`` < 1, a bad ``--k``.
        megarl.config.ConfigError: ``--hf`` is a hub id that cannot be resolved (offline, not cached).
    """
    if (args.checkpoint is None) == (args.hf is None):
        raise EvalArgumentError("give exactly one model: --checkpoint RUN/checkpoints/step_N or --hf HF_DIR")
    if args.samples is not None and args.samples < 1:
        raise EvalArgumentError(f"argument --samples {args.samples}: at least 1 sample per prompt")
    if args.data is not None and not Path(args.data).is_file():
        raise EvalArgumentError(f"argument --data {args.data}: no such file")
    ks = _parse_ks(args.k)
    if ks and args.samples is not None and ks[-1] > args.samples:
        raise EvalArgumentError(f"argument --k {args.k}: pass@{ks[-1]} needs at least {ks[-1]} samples per prompt "
                                f"(--samples {args.samples})")
    ckpt = hf = None
    if args.checkpoint is not None:
        ckpt = _resolve_checkpoint(args.checkpoint)
    else:
        from megarl.config.hub import resolve_hub_path

        hf = Path(resolve_hub_path(args.hf, "--hf"))  # a hub id: its cached (or downloaded) snapshot
        if not (hf / "config.json").is_file():
            raise EvalArgumentError(f"argument --hf {args.hf}: not a Hugging Face model directory (no config.json)")
        hf = hf.resolve()
    out = Path(args.out) if args.out is not None else _default_out(ckpt, hf)
    return EvalRequest(ckpt, hf, out.resolve(), args.samples, ks)


def _default_out(ckpt: Path | None, hf: Path | None) -> Path:
    """``RUN/eval/step_N.json`` for a trainer checkpoint, else ``runs/eval/<the model's absolute path,
    its parts joined by -->.json`` (``/data/qwen/hf`` -> ``data--qwen--hf.json``, as the hub cache names
    ``models--org--name``): one report per model, not one per directory name (every ``hf/``)."""
    step = _trainer_step_dir(ckpt) if ckpt is not None else None
    if step is not None:
        return step.parent.parent / "eval" / f"{step.name}.json"
    model = ckpt if ckpt is not None else hf
    if model is None:
        raise EvalArgumentError("give exactly one model: --checkpoint RUN/checkpoints/step_N or --hf HF_DIR")
    parts = [p for p in model.resolve().parts if p != "/"]
    return Path("runs") / "eval" / f"{'--'.join(parts)}.json"


def eval_overrides(request: EvalRequest, args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The user's overrides, then what ``megarl eval`` sets (they win): the model to serve, no
    trainer start weights, ``--data`` and ``--samples``."""
    extra = [f"model.hf_path={model_dir}", "model.load_dir=null"]
    if args.data is not None:
        extra.append(f"data.eval_path={Path(args.data).resolve()}")
    if request.samples is not None:
        extra.append(f"data.eval_samples_per_prompt={request.samples}")
    return [*args.overrides, *extra]


def default_ks(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``n``, and ``n`` (empty when ``n`` is 0)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return tuple(ks + [n]) if n > 0 else ()


def export_model(request: EvalRequest) -> Path:
    """The HF directory to serve: ``--hf``; or the checkpoint's export, reused from ``RUN/hf/step_N``
    when the run wrote one, else written to ``work_dir/hf`` by megarl's converter."""
    from megarl.conversion.convert import megatron_to_hf_dir

    if request.hf_dir is not None:
        return request.hf_dir
    ckpt = request.checkpoint_dir()
    step = _trainer_step_dir(ckpt)
    if step is not None:
        done = step.parent.parent / "hf" / step.name
        if (done / "config.json").is_file():  # the run's exports are renamed into place when complete
            logger.info("serving the run's own export %s", done)
            return done
    out = request.work_dir / "hf"
    logger.info("exporting %s to %s", ckpt, out)
    return megatron_to_hf_dir(ckpt, out, overwrite=True)


def evaluate_model(cfg: MegarlConfig, rows: list[dict], log_dir: Path,
                   policy_version: int = 0) -> tuple[dict, str, dict]:
    """Start the run's engines on ``cfg.model.hf_path`` and the rollout actor, evaluate ``rows``
    and stop everything.

    Returns:
        ``eval/*`` metrics (as the training run logs them), the first greedy trajectory as text,
        and the records ``{"greedy": [...], "sampled": [...]}``.
    """
    import ray
    from omegaconf import OmegaConf

    from megarl.cluster.bundles import bundle_shapes
    from megarl.cluster.placement import build_placement, init_ray
    from megarl.cluster.ray_engines import EngineGroup
    from megarl.cluster.retrieval import start_retrieval, stop_retrieval
    from megarl.launch.rollout_actor import RolloutWorker

    shapes = bundle_shapes(cfg, engines_only=True)  # no trainer rank: the engines' devices only
    started = init_ray(cfg, cuda=shapes.cuda)
    placement = engines = worker = retrieval = None
    try:
        placement = build_placement(cfg, shapes)
        engines = EngineGroup(cfg, placement, cfg.model.hf_path, log_dir)
        retrieval = start_retrieval(cfg, log_dir)  # sets rollout.tools.search.url
        urls = engines.wait_ready()
        worker = RolloutWorker.options(num_cpus=0).remote(  # type: ignore[attr-defined]  # a Ray actor class
            OmegaConf.to_yaml(cfg, resolve=True), urls, engines.ids)
        return ray.get(worker.evaluate_records.remote(rows, policy_version))
    finally:
        if worker is not None:
            try:
                ray.get(worker.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - teardown
                pass
            ray.kill(worker, no_restart=True)
        stop_retrieval(retrieval)
        if engines is not None:
            engines.shutdown()
        if placement is not None:
            placement.remove()
        if started:
            ray.shutdown()


def run_eval(args: argparse.Namespace) -> int:
    """``megarl eval`` (the module docstring); returns the exit status.

    Raises:
        EvalArgumentError: see :func:`check_args`; also when the config has no evaluation data.
        megarl.config.ConfigError: the recipe with the evaluation's overrides is invalid.
    """
    from megarl.launch.eval_report import build_report, print_report, write_report
    from megarl.launch.preflight import prepare_config
    from megarl.launch.run import load_datasets
    from megarl.plugins import import_plugins

    request = check_args(args)
    config_dir = request.hf_dir or _checkpoint_config_dir(request.checkpoint_dir())
    cfg = as_megarl_config(prepare_config(args.config, eval_overrides(request, args, config_dir), check_fit=False))
    if not cfg.data.eval_path:
        raise EvalArgumentError("no evaluation data: set data.eval_path in the recipe or pass --data FILE")
    n = int(cfg.data.eval_samples_per_prompt) or 1
    cfg.data.eval_samples_per_prompt = n
    ks = request.ks or default_ks(n)
    if ks[-1] > n:
        raise EvalArgumentError(f"argument --k: pass@{ks[-1]} needs at least {ks[-1]} samples per prompt (n = {n}; "
                                f"pass --samples)")
    import_plugins(cfg.plugins)  # user dataset readers, before the rows are read
    rows = load_datasets(cfg.data)[1] or []
    cfg.model.hf_path = str(export_model(request))
    request.work_dir.mkdir(parents=True, exist_ok=True)
    version = _policy_version(request.checkpoint)
    metrics, sample, records = evaluate_model(cfg, rows, request.work_dir, version)
    logger.info("eval sample: %s", sample)
    source = {"model": str(request.checkpoint or request.hf_dir), "served": cfg.model.hf_path,
              "config": str(args.config), "data": str(cfg.data.eval_path), "policy_version": version,
              "seed": int(cfg.train.seed)}
    report = build_report(records, num_prompts=len(rows), samples_per_prompt=n, ks=ks, run_metrics=metrics,
                          source=source)
    write_report(report, request.out)
    print_report(report)
    print(f"wrote {request.out}")
    return 0


def _checkpoint_config_dir(ckpt: Path) -> Path:
    """The HF config and tokenizer a checkpoint stores (``hf_config/``), to validate the recipe
    with before the export.

    Raises:
        EvalArgumentError: the checkpoint has none.
    """
    from megarl.conversion.convert import HF_CONFIG_SUBDIR

    stored = ckpt / HF_CONFIG_SUBDIR
    if not (stored / "config.json").is_file():
        raise EvalArgumentError(f"argument --checkpoint {ckpt}: no {HF_CONFIG_SUBDIR}/config.json in it; export it "
                                f"with `megarl convert megatron-to-hf CKPT OUT --hf-config HF_DIR` and pass --hf OUT")
    return stored


def _policy_version(ckpt: Path | None) -> int:
    """The policy version a trainer checkpoint's driver state records (0 otherwise)."""
    from megarl.launch import run_state as rs

    step = _trainer_step_dir(ckpt) if ckpt is not None else None
    if step is None or not (step / rs.DRIVER_STATE).is_file():
        return 0
    return int(rs.load_driver_state(step).policy_version)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``megarl eval``'s arguments (the checks are :func:`check_args`', one line each)."""
    parser.add_argument("config", help="the recipe (YAML) whose agent loop, tools, reward and engines are used")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `megarl train`")
    parser.add_argument("--checkpoint", default=None,
                        help="a trainer checkpoint RUN/checkpoints/step_N (any layout) or any dist checkpoint")
    parser.add_argument("--hf", default=None, help="a Hugging Face model directory")
    parser.add_argument("--data", default=None, help="evaluation rows (default: data.eval_path)")
    parser.add_argument("--samples", type=int, default=None,
                        help="sampled trajectories per prompt, n (default: data.eval_samples_per_prompt, or 1)")
    parser.add_argument("--k", default=None, help="pass@k budgets, e.g. 1,4,8 (default: 1, 2, 4, ... up to n)")
    parser.add_argument("--out", default=None,
                        help="the JSON report (default: RUN/eval/step_N.json, or runs/eval/<model path, / as -->.json)")
