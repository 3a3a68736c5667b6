"""The ``megarl plan`` report: memory per rank, bytes and seconds per step, weight-sync seconds.

Per step, from the run config and an expected trajectory length ``S`` tokens (prompt + response;
``--tokens-per-trajectory``, default half of ``data.max_prompt_tokens + rollout.agent.max_response_tokens``):

- tokens per step ``N = num_prompts_per_step x group_size x S``;
- bytes the object store carries to the trainer per step (``megarl plan`` prints the data path's
  own prediction, ``megarl.launch.data_plan.plan_step_bytes``, handed in by the CLI; this is the
  fallback): token ids (8 B), loss mask (1 B), rollout logprobs (4 B) per token, R3's routes ``L x K x 4 B`` per token
  (``train.routing_replay:
  r3``); each trainer rank receives its data-parallel share (``/ DP``); old logprobs (4 B per token)
  are computed and kept on the ranks; the driver receives metrics only (``METRICS_BYTES`` per rank);
- trainer seconds = FLOPs / (world x peak x MFU): ``6 x active x N`` for the training pass, ``2 x
  active x N`` for each logprob pass (old logprobs; reference logprobs when ``algorithm.kl_coef >
  0``), plus attention ``2 x heads x (d_qk + d_v) x S / 2`` per token and layer per forward (x 3
  for training); peak is the GPU's BF16 (FP8 with ``train.fp8``) dense peak. Generation is not
  included.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.fit import RESIDENT, Fit, resident_bytes
from megarl.plan.gpus import GpuSpec
from megarl.plan.memory import GB, TrainerSetup, trainer_memory
from megarl.plan.shape import ModelShape

METRICS_BYTES = 16 * 1024
"""Scalar metrics one trainer rank returns to the driver per call (an upper bound)."""


@dataclass
class StepPlan:
    """Bytes and seconds of one RL step on paper (module docstring)."""

    tokens: int
    object_store_bytes: int
    rank_bytes: int
    driver_bytes: int
    trainer_flops: float
    trainer_s: float


def step_plan(cfg, shape: ModelShape, gpu: GpuSpec, setup: TrainerSetup, *, tokens_per_trajectory: int,
              mfu: float) -> StepPlan:
    """Per-step bytes and trainer seconds (module docstring).

    Raises:
        ValueError: ``mfu`` outside (0, 1] or a non-positive trajectory length.
    """
    if not 0 < mfu <= 1 or tokens_per_trajectory < 1:
        raise ValueError(f"--mfu must be in (0, 1] and --tokens-per-trajectory >= 1 "
                         f"(got {mfu}, {tokens_per_trajectory})")
    trajectories = int(cfg.rollout.num_prompts_per_step) * int(cfg.rollout.group_size)
    tokens = trajectories * tokens_per_trajectory
    per_token = 8 + 1 + 4
    if cfg.train.routing_replay == "r3":
        per_token += sum(shape.moe_layers) * shape.topk * 4
    store = tokens * per_token
    if shape.mla:
        attn_dims = shape.num_attention_heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    else:
        attn_dims = shape.num_attention_heads * 2 * shape.head_dim
    attention = 2 * attn_dims * tokens_per_trajectory / 2 * shape.num_layers * tokens
    passes = 1 + (float(cfg.algorithm.kl_coef) > 0)
    flops = (6 * shape.active_params() * tokens + 3 * attention
             + passes * (2 * shape.active_params() * tokens + attention))
    peak = gpu.fp8_tflops if cfg.train.fp8 is not None else gpu.bf16_tflops
    seconds = flops / (setup.world_size * peak * 1e12 * mfu)
    return StepPlan(tokens, store, store // max(setup.dp, 1), METRICS_BYTES * setup.world_size, flops, seconds)


def default_tokens_per_trajectory(cfg) -> int:
    """Half of the prompt and response budgets: ``(data.max_prompt_tokens + agent.max_response_tokens) / 2``."""
    return (int(cfg.data.max_prompt_tokens) + int(cfg.rollout.agent.max_response_tokens)) // 2


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def format_trainer(fit: Fit, shape: ModelShape, setup: TrainerSetup) -> list[str]:
    """The trainer block: layout, the most loaded rank's consumers, activations per recompute setting."""
    m, s = fit.trainer, setup
    lines = [f"trainer: world {s.world_size} = TP{s.tp} x PP{s.pp} x CP{s.cp} x DP{s.dp}; "
             f"experts EP{s.ep} x ETP{s.etp} (expert-DP {s.expert_dp}); "
             f"distributed optimizer {'on' if s.distributed_optimizer else 'off'}; "
             f"recompute {s.recompute or 'none'}; {s.tokens_per_microbatch} tokens per micro batch",
             f"  most loaded rank: pipeline stage {m.stage}, {m.params / 1e9:.2f} B parameters",
             "  consumer            GB"]
    lines += [f"  {name:<18} {_gb(nbytes):>7}" for name, nbytes in m.consumers.items()]
    verdict = "fits" if fit.trainer_fits else "DOES NOT FIT"
    lines.append(f"  {'total':<18} {_gb(m.total):>7}  of {fit.gpu.memory_text} ({fit.gpu.name}): {verdict}")
    other = []
    for recompute in (None, "selective", "full"):
        mem = trainer_memory(shape, TrainerSetup(**{**s.__dict__, "recompute": recompute}))
        other.append(f"{recompute or 'none'} {_gb(mem.consumers['activations'])} GB (total {_gb(mem.total)})")
    lines.append("  activations by model.recompute_granularity: " + ", ".join(other))
    if fit.colocated_limit is not None:
        kept = resident_bytes(m, fit.offloaded)
        names = ", ".join(n.replace("_", " ") for n in RESIDENT if n not in fit.offloaded)
        moved = f"; offloaded: {', '.join(n.replace('_', ' ') for n in fit.offloaded)}" if fit.offloaded else ""
        lines.append(f"  colocated: kept between steps ({names}{moved}) "
                     f"{_gb(kept)} GB of its fraction {_gb(fit.colocated_limit)} GB: "
                     f"{'fits' if fit.colocated_fits else 'DOES NOT FIT'}")
    return lines


def format_engine(fit: Fit, cfg, fp8: bool) -> list[str]:
    """The engine block: weights and KV cache per engine rank, tokens of context that fit, and how many of
    the sequences the engine serves at once fit at their context limit."""
    e, eng = fit.engine, cfg.rollout.engine
    verdict = "fits" if fit.engine_fits else "DOES NOT FIT"
    return [f"engines: {cfg.rollout.num_engines} x TP{eng.tensor_parallel_size} EP{eng.expert_parallel_size} "
            f"({'block FP8' if fp8 else 'BF16' if eng.dtype != 'float32' else 'FP32'} weights), "
            f"mem_fraction_static {eng.mem_fraction_static}",
            f"  per engine rank: weights {_gb(e.weights)} GB, KV cache {e.kv_per_token / 1024:.1f} KiB per token, "
            f"KV pool {_gb(max(e.kv_pool, 0))} GB -> {e.tokens_fit} tokens of context",
            f"  serves {fit.concurrency} sequences at once (its share of the step's trajectories, capped by "
            f"--max-running-requests); at rollout.agent.max_context_tokens {fit.max_context_tokens} the pool holds "
            f"{fit.sequences_fit}: {verdict}"]


def format_step(step: StepPlan, mfu: float, tokens_per_trajectory: int, sync_s: dict[str, float]) -> list[str]:
    """The per-step block: tokens, bytes, trainer seconds, weight-sync seconds."""
    lines = [f"step: {step.tokens} tokens ({tokens_per_trajectory} per trajectory); object store -> trainer "
             f"{_gb(step.object_store_bytes)} GB ({_gb(step.rank_bytes)} GB per rank); driver <- trainer "
             f"{step.driver_bytes / 1e6:.2f} MB (metrics)",
             f"  trainer {step.trainer_flops / 1e15:.1f} PFLOP -> {step.trainer_s:.1f} s at MFU {mfu:g} "
             "(generation not included)"]
    if sync_s:
        lines.append("  weight sync (megarl plan-sync): " + ", ".join(f"{t} {s:.2f} s" for t, s in sync_s.items()))
    return lines
