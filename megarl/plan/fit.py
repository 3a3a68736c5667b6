"""Does a run config fit its GPUs? The check ``megarl validate`` runs, and ``megarl plan --suggest``'s search.

Both read the run config's sections by attribute (an OmegaConf config or the schema's dataclasses)
and the model's ``transformers`` config; nothing here imports the config package (it calls us).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.plan.gpus import GpuSpec, detect_gpu, gpu_spec
from megarl.plan.memory import GB, EngineMemory, EngineSetup, RankMemory, TrainerSetup, engine_memory, trainer_memory
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
                       weight_bytes=4 if e.dtype == "float32" else 2, mem_fraction_static=float(e.mem_fraction_static),
                       max_total_tokens=None if e.max_total_tokens is None else int(e.max_total_tokens))


def max_running_requests(extra_args) -> int | None:
    """SGLang ``--max-running-requests N`` (or ``=N``) among ``rollout.engine.extra_args``; None if absent."""
    args = [str(a) for a in extra_args or ()]
    for i, arg in enumerate(args):
        if arg == "--max-running-requests" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--max-running-requests="):
            return int(arg.split("=", 1)[1])
    return None


def engine_concurrency(cfg) -> int:
    """Sequences one engine serves at once: its share of a step's trajectories
    (``(num_prompts_per_step + over_sample_prompts) x group_size`` over the engines, rounded up),
    capped by ``--max-running-requests`` in ``rollout.engine.extra_args``."""
    r = cfg.rollout
    engines = len(r.external_engine_urls) or int(r.num_engines)
    trajectories = (int(r.num_prompts_per_step) + int(r.over_sample_prompts)) * int(r.group_size)
    share = -(-trajectories // max(engines, 1))
    cap = max_running_requests(r.engine.extra_args)
    return max(min(share, cap) if cap else share, 1)


@dataclass
class Fit:
    """Memory of the most loaded trainer rank and of an engine rank on one GPU model."""

    gpu: GpuSpec
    trainer: RankMemory
    engine: EngineMemory
    max_context_tokens: int
    concurrency: int = 1
    """Sequences one engine serves at once (:func:`engine_concurrency`)."""
    colocated_limit: float | None = None
    """Colocated: bytes a trainer rank may keep while the engines hold theirs
    (``cluster.colocated_trainer_memory_fraction`` x memory); None when disaggregated."""
    offloaded: tuple[str, ...] = ()
    """Consumers moved off the GPU while the engines hold theirs (:data:`OFFLOADED`)."""

    @property
    def colocated_fits(self) -> bool:
        """Disaggregated, or the trainer's resident memory (:func:`resident_bytes`) within its fraction."""
        return self.colocated_limit is None or resident_bytes(self.trainer, self.offloaded) <= self.colocated_limit

    @property
    def trainer_fits(self) -> bool:
        """The busiest trainer rank's planned bytes fit the GPU's memory (``gpu.memory_bytes``)."""
        return self.trainer.total <= self.gpu.memory_bytes

    @property
    def sequences_fit(self) -> int:
        """Sequences at ``rollout.agent.max_context_tokens`` the engine's KV pool holds at once."""
        return self.engine.tokens_fit // max(self.max_context_tokens, 1)

    @property
    def engine_fits(self) -> bool:
        """The KV pool holds every sequence the engine serves at once at its context limit."""
        return self.sequences_fit >= self.concurrency


def plan_fit(cfg, hf_config, gpu: GpuSpec, *, precision: str) -> Fit:
    """Trainer and engine memory of the run config on ``gpu``."""
    shape = ModelShape.from_hf_config(hf_config)
    return Fit(gpu, trainer_memory(shape, TrainerSetup.from_config(cfg, precision=precision)),
               engine_memory(shape, engine_setup(cfg, hf_config), gpu.memory_bytes),
               int(cfg.rollout.agent.max_context_tokens), engine_concurrency(cfg),
               float(cfg.cluster.colocated_trainer_memory_fraction) * gpu.memory_bytes
               if cfg.cluster.placement == "colocated" else None, OFFLOADED[cfg.cluster.colocated_offload])


def _trainer_hint(name: str, cfg, setup: TrainerSetup) -> str:
    """What would shrink consumer ``name``, given what the config already sets."""
    if name in ("weights", "gradients"):
        return ("raise parallel.expert_model_parallel_size (routed experts) or parallel.tensor_model_parallel_size / "
                "parallel.pipeline_model_parallel_size (the rest)")
    if name in ("main_weights", "adam_states"):
        if not setup.distributed_optimizer:
            return "set parallel.use_distributed_optimizer=true (divides them over data parallel)"
        if setup.expert_dp == 1:
            return (f"the distributed optimizer is on, but the routed experts have one data-parallel copy (expert-DP "
                    f"= world {setup.world_size} / (EP{setup.ep} x ETP{setup.etp} x PP{setup.pp}) = 1): their state "
                    "cannot shard further; raise parallel.pipeline_model_parallel_size (fewer layers per rank) or "
                    "cluster.trainer_nodes with parallel.expert_model_parallel_size (fewer experts per rank)")
        return ("the distributed optimizer divides them over data parallel: more cluster.trainer_nodes, or "
                "parallel.pipeline_model_parallel_size (fewer layers per rank)")
    if name == "activations" and cfg.model.recompute_granularity != "full":
        return "set model.recompute_granularity=full, or lower train.max_tokens_per_microbatch"
    return "lower train.max_tokens_per_microbatch (or raise parallel.tensor_model_parallel_size)"


def _engine_problem(fit: Fit, cfg, fp8: bool) -> str:
    """The engine refusal: what the KV pool holds, what the engine serves at once, what would help."""
    e, gpu, eng = fit.engine, fit.gpu, cfg.rollout.engine
    helps = []
    if fit.sequences_fit >= 1:
        helps.append(f'rollout.engine.extra_args=["--max-running-requests","{fit.sequences_fit}"] (the rest wait)')
    spans = int(eng.tensor_parallel_size) >= gpu.gpus_per_node
    helps.append("raise rollout.engine.tensor_parallel_size" + (" (an engine over several nodes)" if spans else ""))
    if not fp8:
        helps.append("serve a block-FP8 checkpoint")
    if float(eng.mem_fraction_static) < 0.9:
        helps.append("raise rollout.engine.mem_fraction_static")
    return (f"an engine rank holds {e.weights / GB:.1f} GB of weights; mem_fraction_static {eng.mem_fraction_static} x "
            f"{gpu.memory_text} ({gpu.name}) leaves a KV pool of {e.tokens_fit} tokens ({e.kv_per_token} B per token): "
            f"{fit.sequences_fit} sequence(s) of rollout.agent.max_context_tokens={fit.max_context_tokens}, fewer "
            f"than the {fit.concurrency} it serves at once (its share of the step's trajectories, capped by "
            f"--max-running-requests): " + ", or ".join(helps))


RESIDENT = ("weights", "gradients", "main_weights", "adam_states", "reserved")
"""What a trainer rank keeps between steps: its activations, logits and dispatch buffers are freed after
the step and their cached blocks released (``torch.cuda.empty_cache``) before colocated engines resume."""


OFFLOADED = {"none": (), "optimizer": ("main_weights", "adam_states"),
             "optimizer_and_grads": ("main_weights", "adam_states", "gradients")}
"""``cluster.colocated_offload`` -> the consumers of :data:`RESIDENT` it moves off the GPU while the
engines hold theirs (Megatron-Core's ``offload_to_cpu`` / ``offload_grad_buffers``,
`megarl.training.memory_limit`)."""


def resident_bytes(mem: RankMemory, offloaded: tuple[str, ...] = ()) -> int:
    """Bytes of :data:`RESIDENT` on a trainer rank but ``offloaded``: what it holds while colocated
    engines hold theirs."""
    return sum(mem.consumers[name] for name in RESIDENT if name not in offloaded)


def _colocated_problem(fit: Fit, cfg) -> str | None:
    """Colocated: the trainer's resident memory against ``cluster.colocated_trainer_memory_fraction``."""
    if fit.colocated_fits:
        return None
    fraction = float(cfg.cluster.colocated_trainer_memory_fraction)
    limit, resident = fit.colocated_limit, resident_bytes(fit.trainer, fit.offloaded)
    assert limit is not None  # colocated_fits holds without a limit
    reserved = fit.trainer.consumers["reserved"]
    kept = ", ".join(n.replace("_", " ") for n in RESIDENT[:-1] if n not in fit.offloaded)
    more = [k for k, names in OFFLOADED.items() if set(names) > set(fit.offloaded)
            and resident_bytes(fit.trainer, names) <= limit]
    offload = (f"set cluster.colocated_offload={more[0]} "
               f"(fits: {resident_bytes(fit.trainer, OFFLOADED[more[0]]) / GB:.1f} GB), or " if more else "")
    return (f"colocated: between steps a trainer rank (pipeline stage {fit.trainer.stage}) keeps "
            f"{(resident - reserved) / GB:.1f} GB ({kept}) + "
            f"{reserved / GB:.1f} GB reserved = {resident / GB:.1f} GB, more than its limit while the engines hold "
            f"theirs, cluster.colocated_trainer_memory_fraction={fraction} x {fit.gpu.memory_text} = "
            f"{limit / GB:.1f} GB (torch.cuda.set_per_process_memory_fraction): {offload}raise the fraction and lower "
            "rollout.engine.mem_fraction_static, or spread the trainer over more GPUs (megarl plan shows every "
            "consumer)")


def fit_problems(cfg, hf_config, gpu: GpuSpec, *, precision: str) -> list[tuple[str, str]]:
    """``(key, message)`` for each side that does not fit ``gpu``: the largest consumer and what to change."""
    fit = plan_fit(cfg, hf_config, gpu, precision=precision)
    setup = TrainerSetup.from_config(cfg, precision=precision)
    out = []
    if not fit.trainer_fits:
        name, nbytes = fit.trainer.largest()
        if name == "activations" and cfg.model.recompute_granularity == "full":
            key = "train.max_tokens_per_microbatch"
        elif name in ("weights", "gradients") and cfg.parallel.expert_model_parallel_size == 1 and \
                not any(ModelShape.from_hf_config(hf_config).moe_layers):
            key = "parallel.tensor_model_parallel_size"
        elif name in ("main_weights", "adam_states") and not setup.distributed_optimizer:
            key = "parallel.use_distributed_optimizer"
        elif name in ("main_weights", "adam_states") and setup.expert_dp == 1:
            key = "parallel.pipeline_model_parallel_size"
        else:
            key = TRAINER_KEYS[name]
        out.append((key, f"a trainer rank (pipeline stage {fit.trainer.stage}) needs {fit.trainer.total / GB:.1f} GB, "
                         f"more than the {gpu.memory_text} of cluster.gpu={gpu.name}; largest: {name} "
                         f"{nbytes / GB:.1f} GB: {_trainer_hint(name, cfg, setup)} (megarl plan shows every "
                         "consumer; megarl plan --suggest a layout that fits)"))
    if not fit.engine_fits:
        out.append(("rollout.engine.tensor_parallel_size", _engine_problem(fit, cfg, is_block_fp8(hf_config))))
    colocated = _colocated_problem(fit, cfg)
    if colocated:
        out.append(("cluster.colocated_trainer_memory_fraction", colocated))
    for key in ("cluster.trainer_devices_per_node", "cluster.rollout_devices_per_node"):
        name = key.split(".")[1]
        per_node = int(getattr(cfg.cluster, name))
        if per_node > gpu.gpus_per_node and (name == "trainer_devices_per_node" or cfg.cluster.placement ==
                                             "disaggregated"):
            out.append((key, f"{per_node} GPUs per node, but a {gpu.name} node has {gpu.gpus_per_node}"))
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
                   tokens: int) -> tuple[EngineSetup, EngineMemory] | None:
    """The smallest engine (GPUs, all on one node; EP = TP for MoE models) whose KV pool holds
    ``tokens`` (the sequences it serves at once x their context limit) on ``gpu``, or None."""
    for tp in (1, 2, 4, 8, 16, 32):
        if tp > gpus_per_node:
            break
        layout = replace(base, tp=tp, ep=tp if shape.num_experts else 1)
        mem = engine_memory(shape, layout, gpu.memory_bytes)
        if mem.tokens_fit >= tokens:
            return layout, mem
    return None
