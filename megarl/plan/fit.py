"""Does a run config fit its GPUs? The check ``megarl validate`` runs, and ``megarl plan --suggest``'s search.

Both read the run config's sections by attribute (an OmegaConf config or the schema's dataclasses)
and the model's ``transformers`` config; nothing here imports the config package (it calls us).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.plan.gpus import GpuSpec, detect_gpu, gpu_spec
from megarl.plan.memory import (GB, EngineMemory, EngineSetup, RankMemory, TrainerSetup, engine_memory,
                                trainer_memory)
from megarl.plan.shape import ModelShape

TRAINER_KEYS = {
    "weights": "parallel.expert_model_parallel_size",
    "gradients": "parallel.expert_model_parallel_size",
    "main_weights": "cluster.trainer_nodes",
    "adam_states": "cluster.trainer_nodes",
    "activations": "model.recompute_granularity",
    "logits": "train.max_tokens_per_microbatch",
    "dispatch_buffers": "train.max_tokens_per_microbatch",
    "reserved": "cluster.gpu",
}
"""The key to change when a consumer is the largest (see :func:`_trainer_hint` for the why)."""


def known_gpu(cfg) -> GpuSpec | None:
    """The run's GPU: ``cluster.gpu``, else (``cluster.device: cuda``) this node's; None on CPU runs.

    Raises:
        ValueError: an unknown ``cluster.gpu`` (named).
    """
    if cfg.cluster.device == "cpu":
        return None
    if cfg.cluster.gpu is not None:
        return gpu_spec(cfg.cluster.gpu)
    return detect_gpu() if cfg.cluster.device == "cuda" else None


def is_block_fp8(hf_config) -> bool:
    """The checkpoint's ``quantization_config`` is block FP8 (DeepSeek-V3's official release, Qwen3 ``-FP8``)."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return False
    q = q if isinstance(q, dict) else q.to_dict()
    return q.get("quant_method") == "fp8" and q.get("weight_block_size") is not None


def engine_setup(cfg, hf_config) -> EngineSetup:
    """The engine's layout and memory settings from ``rollout.engine`` and the checkpoint."""
    e = cfg.rollout.engine
    return EngineSetup(tp=int(e.tensor_parallel_size), ep=int(e.expert_parallel_size), fp8=is_block_fp8(hf_config),
                       weight_bytes=4 if e.dtype == "float32" else 2, mem_fraction_static=float(e.mem_fraction_static))


@dataclass
class Fit:
    """Memory of the most loaded trainer rank and of an engine rank on one GPU model."""

    gpu: GpuSpec
    trainer: RankMemory
    engine: EngineMemory
    max_context_tokens: int

    @property
    def trainer_fits(self) -> bool:
        return self.trainer.total <= self.gpu.memory_bytes

    @property
    def engine_fits(self) -> bool:
        return self.engine.tokens_fit >= self.max_context_tokens


def plan_fit(cfg, hf_config, gpu: GpuSpec, *, precision: str) -> Fit:
    """Trainer and engine memory of the run config on ``gpu``."""
    shape = ModelShape.from_hf_config(hf_config)
    return Fit(gpu, trainer_memory(shape, TrainerSetup.from_config(cfg, precision=precision)),
               engine_memory(shape, engine_setup(cfg, hf_config), gpu.memory_bytes),
               int(cfg.rollout.agent.max_context_tokens))


def _trainer_hint(name: str, cfg) -> str:
    if name in ("weights", "gradients"):
        return ("raise parallel.expert_model_parallel_size (routed experts) or parallel.tensor_model_parallel_size / "
                "pipeline_model_parallel_size (the rest)")
    if name in ("main_weights", "adam_states"):
        return ("the distributed optimizer divides them over data parallel: more cluster.trainer_nodes, "
                "or parallel.use_distributed_optimizer=true")
    if name == "activations" and cfg.model.recompute_granularity != "full":
        return "set model.recompute_granularity=full, or lower train.max_tokens_per_microbatch"
    return "lower train.max_tokens_per_microbatch (or raise parallel.tensor_model_parallel_size)"


def fit_problems(cfg, hf_config, gpu: GpuSpec, *, precision: str) -> list[tuple[str, str]]:
    """``(key, message)`` for each side that does not fit ``gpu``: the largest consumer and what to change."""
    fit = plan_fit(cfg, hf_config, gpu, precision=precision)
    out = []
    if not fit.trainer_fits:
        name, nbytes = fit.trainer.largest()
        if name == "activations" and cfg.model.recompute_granularity == "full":
            key = "train.max_tokens_per_microbatch"
        elif name in ("weights", "gradients") and cfg.parallel.expert_model_parallel_size == 1 and \
                not any(ModelShape.from_hf_config(hf_config).moe_layers):
            key = "parallel.tensor_model_parallel_size"
        else:
            key = TRAINER_KEYS[name]
        out.append((key, f"a trainer rank (pipeline stage {fit.trainer.stage}) needs {fit.trainer.total / GB:.1f} GB, "
                         f"more than the {gpu.memory_bytes / GB:.0f} GB of cluster.gpu={gpu.name}; largest: {name} "
                         f"{nbytes / GB:.1f} GB: {_trainer_hint(name, cfg)} (megarl plan shows every consumer; "
                         "megarl plan --suggest a layout that fits)"))
    if not fit.engine_fits:
        e = fit.engine
        out.append(("rollout.engine.tensor_parallel_size",
                    f"an engine rank holds {e.weights / GB:.1f} GB of weights; mem_fraction_static x "
                    f"{gpu.memory_bytes / GB:.0f} GB ({gpu.name}) leaves room for {e.tokens_fit} tokens of KV cache "
                    f"({e.kv_per_token} B per token), fewer than rollout.agent.max_context_tokens="
                    f"{fit.max_context_tokens}: raise rollout.engine.tensor_parallel_size (or serve a block-FP8 "
                    "checkpoint, or raise rollout.engine.mem_fraction_static)"))
    return out


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def suggest_trainer(shape: ModelShape, base: TrainerSetup, gpu: GpuSpec, gpus_per_node: int, *,
                    max_nodes: int = 128) -> tuple[int, TrainerSetup, RankMemory] | None:
    """The fewest nodes whose best TP / PP / EP layout fits ``gpu``: ``(nodes, layout, memory)`` or None.

    Among the layouts of the smallest node count that fit, the one with the most free memory.
    TP up to the node size and dividing the attention heads / query groups, PP up to 16 (an uneven
    split puts the rest on the last stage: ``parallel.num_layers_in_last_pipeline_stage``), EP
    dividing the experts and the ranks of a stage; ETP 1; CP as ``base``.
    """
    heads = shape.num_attention_heads if shape.mla else min(shape.num_attention_heads, shape.num_kv_heads)
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node and heads % t == 0]
    pps = [p for p in (1, 2, 4, 8, 16) if p <= shape.num_layers]
    for nodes in range(1, max_nodes + 1):
        world = nodes * gpus_per_node
        best = None
        for tp in tps:
            for pp in pps:
                if world % (tp * pp * base.cp):
                    continue
                for ep in _divisors(shape.num_experts, world // pp) if shape.num_experts else [1]:
                    if (world // pp) % ep:
                        continue
                    uneven = shape.num_layers % pp  # Megatron: the rest of an uneven split on the last stage
                    last = shape.num_layers - (pp - 1) * (shape.num_layers // pp) if uneven else None
                    layout = replace(base, world_size=world, tp=tp, pp=pp, ep=ep, etp=1,
                                     sequence_parallel=tp > 1, vpp=None, num_layers_first=None, num_layers_last=last)
                    mem = trainer_memory(shape, layout)
                    if mem.total <= gpu.memory_bytes and (best is None or mem.total < best[2].total):
                        best = (nodes, layout, mem)
        if best is not None:
            return best
    return None


def suggest_engine(shape: ModelShape, base: EngineSetup, gpu: GpuSpec, gpus_per_node: int,
                   max_context_tokens: int) -> tuple[EngineSetup, EngineMemory] | None:
    """The smallest engine (GPUs, all on one node; EP = TP for MoE models) whose KV cache holds
    ``max_context_tokens`` on ``gpu``, or None."""
    for tp in (1, 2, 4, 8, 16, 32):
        if tp > gpus_per_node:
            break
        layout = replace(base, tp=tp, ep=tp if shape.num_experts else 1)
        mem = engine_memory(shape, layout, gpu.memory_bytes)
        if mem.tokens_fit >= max_context_tokens:
            return layout, mem
    return None
