"""``megarl plan CONFIG [overrides]``: capacity before queueing (the report of `megarl.plan.report`).

The command (wired by ``megarl/cli.py``, which hands in the validated config, the model's
``config.json`` and the weight-sync prediction) prints the most loaded trainer rank's memory by
consumer, an engine rank's weights and KV cache, the per-step bytes and seconds, and the
weight-sync seconds of ``megarl plan-sync`` at the GPU's link bandwidths. ``--suggest`` adds the
fewest nodes of the GPU, and their layout, on which trainer and engines fit.
"""
from __future__ import annotations

from collections.abc import Callable

from megarl.plan.allocation import run_nodes, sbatch_command
from megarl.plan.fit import engine_setup, plan_fit, suggest_engine, suggest_trainer
from megarl.plan.gpus import GPUS, detect_gpu, gpu_spec
from megarl.plan.memory import GB, TrainerSetup
from megarl.plan.report import default_tokens_per_trajectory, format_engine, format_step, format_trainer, step_plan
from megarl.plan.shape import ModelShape

SyncSeconds = Callable[[object, float, float], dict]
"""``(cfg, intra_gbps, inter_gbps) -> {transport: seconds}``: ``megarl plan-sync``'s prediction of the
sender path that runs (``megarl.weight_sync.predict.sync_seconds``), at the links of the GPU preset."""
StepBytes = Callable[[object, int], tuple]
"""``(cfg, tokens_per_trajectory) -> (object store, per rank, driver) bytes`` of one step
(``megarl.launch.data_plan.plan_step_bytes``, the data path's own prediction)."""


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand's arguments."""
    p = sub.add_parser("plan", help="memory per trainer / engine rank, bytes and seconds per step, on paper")
    p.add_argument("config", help="YAML run config (model.hf_path needs only config.json)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--gpu", choices=["auto", *GPUS], default=None,
                   help="GPU preset (default: cluster.gpu, else this node's GPU)")
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation (default 0.35)")
    p.add_argument("--tokens-per-trajectory", type=int, default=None,
                   help="expected prompt + response tokens (default: half of their budgets)")
    p.add_argument("--suggest", action="store_true", help="also name the fewest nodes and a layout that fit")
    p.add_argument("--no-sync", action="store_true", help="skip the weight-sync prediction (slow for 1T models)")


def _suggest(cfg, shape: ModelShape, setup: TrainerSetup, fit, hf_config) -> list[str]:
    """``--suggest``'s lines: every override a full ``section.key=value`` that can be pasted back."""
    gpu = fit.gpu
    per_node = min(int(cfg.cluster.trainer_devices_per_node), gpu.gpus_per_node)
    trainer = suggest_trainer(shape, setup, gpu, per_node)
    lines = []
    if trainer is None:
        lines.append(f"suggest: no trainer layout of up to 128 nodes x {per_node} {gpu.name} fits")
    else:
        nodes, t, mem = trainer
        keys = {"cluster.trainer_nodes": nodes, "cluster.trainer_devices_per_node": per_node,
                "parallel.tensor_model_parallel_size": t.tp, "parallel.pipeline_model_parallel_size": t.pp,
                "parallel.expert_model_parallel_size": t.ep, "parallel.expert_tensor_parallel_size": 1,
                "parallel.sequence_parallel": str(t.tp > 1).lower(),
                "parallel.num_layers_in_first_pipeline_stage": "null",
                "parallel.num_layers_in_last_pipeline_stage": t.num_layers_last or "null",
                "parallel.virtual_pipeline_model_parallel_size": "null"}
        lines.append(f"suggest trainer ({nodes} node(s) x {per_node} {gpu.name}, DP{t.dp}, {mem.total / GB:.1f} GB on "
                     "the most loaded rank): " + " ".join(f"{k}={v}" for k, v in keys.items()))
    cl = cfg.cluster
    rollout_per_node = min(int(cl.rollout_devices_per_node if cl.placement == "disaggregated" else per_node),
                           gpu.gpus_per_node)
    need = fit.concurrency * fit.max_context_tokens
    engine = suggest_engine(shape, engine_setup(cfg, hf_config), gpu, rollout_per_node, need)
    if engine is None:
        lines.append(f"suggest engine: no engine of up to {rollout_per_node} {gpu.name} (one node) holds "
                     f"{fit.concurrency} sequence(s) of {fit.max_context_tokens} tokens ({need} tokens of KV cache): "
                     + ("" if engine_setup(cfg, hf_config).fp8 else "serve a block-FP8 checkpoint, ")
                     + f"a larger GPU, or rollout.engine.extra_args=[--max-running-requests,{fit.sequences_fit}] "
                     "(what the configured engine holds; the rest wait)")
    else:
        e, engine_mem = engine
        per_node_engines = max(rollout_per_node // e.tp, 1)
        nodes = -(-int(cfg.rollout.num_engines) // per_node_engines)
        lines.append(f"suggest engines ({cfg.rollout.num_engines} engine(s) on {nodes} node(s), "
                     f"{engine_mem.tokens_fit} tokens of KV cache each): rollout.engine.tensor_parallel_size={e.tp} "
                     f"rollout.engine.expert_parallel_size={e.ep}"
                     + (f" cluster.rollout_nodes={nodes}" if cl.placement == "disaggregated" else ""))
    return lines


def allocation_lines(args, cfg, gpu) -> list[str]:
    """The allocation the run needs and the ``sbatch`` line that asks for it: the recipe and overrides as
    given (``cluster.gpu=NAME`` added when ``--gpu`` names another GPU than the config's)."""
    need = run_nodes(cfg)
    overrides = list(args.overrides)
    if args.gpu and gpu.name != cfg.cluster.gpu:
        overrides.append(f"cluster.gpu={gpu.name}")
    return [f"allocation: {need.nodes} node(s) ({need.trainer} trainer + {need.rollout} rollout) x "
            f"{gpu.gpus_per_node} {gpu.name}",
            "  " + sbatch_command(args.config, overrides, need.nodes, gpu.gpus_per_node)]


def run_plan(args, cfg, hf_config, sync_seconds: SyncSeconds, *, precision: str,
             step_bytes: StepBytes | None = None) -> int:
    """Print the plan of a validated config; 0 when both sides fit the GPU (colocated: the trainer its
    fraction too), 1 when one does not.

    Args:
        args: the ``plan`` subcommand's arguments (:func:`add_plan_parser`).
        cfg: the validated run config (fit check off).
        hf_config: the model's ``transformers`` config.
        sync_seconds: the weight-sync prediction (module docstring of `megarl.weight_sync.predict`).
        precision: the resolved ``train.precision``.
        step_bytes: the data path's byte prediction (None: `megarl.plan.report.step_plan`'s own).

    Raises:
        ValueError: no GPU named and none on this node; a bad ``--mfu``.
    """
    gpu = gpu_spec(args.gpu or cfg.cluster.gpu) or detect_gpu()
    if gpu is None:
        raise ValueError("megarl plan needs a GPU model: set cluster.gpu or pass --gpu (h100, h200, b200, gb200)")
    shape = ModelShape.from_hf_config(hf_config)
    setup = TrainerSetup.from_config(cfg, precision=precision)
    fit = plan_fit(cfg, hf_config, gpu, precision=precision)
    tokens = args.tokens_per_trajectory or default_tokens_per_trajectory(cfg)
    step = step_plan(cfg, shape, gpu, setup, tokens_per_trajectory=tokens, mfu=args.mfu)
    if step_bytes is not None:
        step.object_store_bytes, step.rank_bytes, step.driver_bytes = step_bytes(cfg, tokens)
    sync = {} if args.no_sync else sync_seconds(cfg, gpu.nvlink_gbps, gpu.network_gbps)
    lines = [f"model {hf_config.architectures[0]}: {shape.total_params() / 1e9:.1f} B parameters "
             f"({shape.active_params() / 1e9:.1f} B active per token); GPU {gpu.name}: {gpu.memory_text}, "
             f"{gpu.bf16_tflops:g} / {gpu.fp8_tflops:g} TFLOP/s BF16 / FP8, links {gpu.nvlink_gbps:g} / "
             f"{gpu.network_gbps:g} GB/s; nodes: {cfg.cluster.trainer_nodes} trainer + "
             f"{cfg.cluster.rollout_nodes if cfg.cluster.placement == 'disaggregated' else 0} rollout"]
    lines += format_trainer(fit, shape, setup)
    lines += format_engine(fit, cfg, engine_setup(cfg, hf_config).fp8)
    lines += format_step(step, args.mfu, tokens, sync)
    lines += allocation_lines(args, cfg, gpu)
    if args.suggest:
        lines += _suggest(cfg, shape, setup, fit, hf_config)
    print("\n".join(lines))
    return 0 if fit.trainer_fits and fit.engine_fits and fit.colocated_fits else 1
