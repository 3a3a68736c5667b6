"""Memory per trainer rank and per engine rank, on paper (``megarl plan``, ``megarl validate``'s fit check).

Trainer rank (Megatron-Core, the most loaded pipeline stage; bytes):

- ``weights``: parameters held, x 2 (BF16; 4 in FP32). Dense parameters (attention, dense MLPs,
  shared experts, the vocabulary) are split over TP; routed experts over EP x ETP; MLA's
  down-projections, norms and routers are whole on every rank.
- ``gradients``: x 4 (megarl reduces gradients in FP32: ``grad_reduce_in_fp32``).
- ``main_weights`` (FP32 copy of BF16 weights, 4 B) and ``adam_states`` (exp_avg + exp_avg_sq, 8 B):
  with the distributed optimizer divided over the parameters' data-parallel group: DP x CP for dense
  parameters, expert-DP = world / (EP x ETP x PP) for routed experts.
- ``activations``: one micro batch of ``T`` tokens (``train.max_tokens_per_microbatch``; / CP per
  rank; / TP under sequence parallelism), per layer and token, ``a`` bytes per element (2 for BF16):
  attention ``a (2h + q + k + v + o_in)`` (+ MLA's latents), dense MLP ``a (2h + 3 ffn)`` (gate+up out,
  SwiGLU out), MoE ``a (2h + 2 K h + 3 K f + 3 f_shared) + 8 E`` (dispatched and combined token copies,
  experts' gate+up and SwiGLU outputs, FP32 router logits and probabilities). Recompute
  (``model.recompute_granularity``): ``none`` keeps all of it plus fused attention's softmax
  statistics (4 B per head); ``selective`` recomputes core attention (what fused attention keeps is
  its output, already counted); ``full`` keeps only each layer's input (``a h``) plus one layer's
  activations while it is recomputed. The first stage holds ``PP`` micro batches in flight (1F1B;
  interleaved: ``x (1 + (PP - 1) / (PP V))``); the last stage holds the logits ``[T / CP, V / TP]``
  in BF16 plus the FP32 log-softmax, 6 B, with or without sequence parallelism: the output layer is a
  ``ColumnParallelLinear`` that all-gathers its sequence-parallel input over TP before the matmul
  (Megatron-Core 0.16.1 ``tensor_parallel/layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication.forward``,
  lines 478-484: ``dist_all_gather_func(all_gather_buffer, input, group=tp_group)``), so every TP rank
  computes all ``T`` tokens' logits for its ``V / TP`` slice of the vocabulary.
- ``dispatch_buffers``: one layer's all-to-all send and receive copies of the dispatched tokens
  (``2 x K x T / TP x h x a``), transient.
- ``reserved``: CUDA context, NCCL and library workspaces, allocator slack: a flat
  :data:`RESERVED_BYTES` (assumed, not derived).

Engine rank (SGLang): weights (BF16, or 1 B + a 4 B scale per 128 x 128 block for the linear
layers of a block-FP8 checkpoint) split over the engine's GPUs (experts over the engine's GPUs
whether by EP or TP; MLA's down-projections whole); KV cache per token: MLA keeps the compressed
``kv_lora_rank + qk_rope_head_dim`` per layer on every rank, GQA ``2 x max(1, kv_heads / TP) x head_dim``
per layer, 2 B per element; tokens of context that fit = ``(mem_fraction_static x memory - weights) /
kv_per_token``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.plan.shape import ModelShape

GB = 1e9
RESERVED_BYTES = int(4 * GB)
"""CUDA context (~0.5-1 GB), NCCL buffers, cuBLAS / Transformer Engine workspaces and allocator
fragmentation on a trainer rank: an assumption, to be replaced by a measurement on the first GPU."""
FP8_BLOCK = 128
"""Block-FP8 checkpoints: one FP32 scale per 128 x 128 block of each linear weight."""


@dataclass(frozen=True)
class TrainerSetup:
    """The trainer's layout and the settings that size its memory (from the run config)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    param_bytes: int = 2
    """2 (BF16 / FP16) or 4 (FP32)."""
    optimizer: str = "adam"
    recompute: str | None = None
    tokens_per_microbatch: int = 4096
    vocab_divisible_by: int = 128
    num_layers_first: int | None = None
    num_layers_last: int | None = None

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world_size / (tp * pp * cp)``."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: ``world_size / (ep * etp * pp)``."""
        return self.world_size // (self.ep * self.etp * self.pp)

    @classmethod
    def from_config(cls, cfg, *, precision: str) -> TrainerSetup:
        """From a run config (``parallel``, ``train``, ``model``, ``cluster``, ``rollout`` sections).

        Args:
            precision: the resolved ``train.precision`` (``bf16``, ``fp16`` or ``fp32``).
        """
        p, t = cfg.parallel, cfg.train
        tokens = t.max_tokens_per_microbatch or t.micro_batch_size * cfg.rollout.agent.max_context_tokens
        etp = p.expert_tensor_parallel_size
        return cls(world_size=int(cfg.cluster.trainer_nodes) * int(cfg.cluster.trainer_devices_per_node),
                   tp=int(p.tensor_model_parallel_size), pp=int(p.pipeline_model_parallel_size),
                   ep=int(p.expert_model_parallel_size),
                   etp=int(p.tensor_model_parallel_size if etp is None else etp), cp=int(p.context_parallel_size),
                   vpp=p.virtual_pipeline_model_parallel_size, sequence_parallel=bool(p.sequence_parallel),
                   distributed_optimizer=bool(p.use_distributed_optimizer),
                   param_bytes=4 if precision == "fp32" else 2, optimizer=str(t.optimizer),
                   recompute=cfg.model.recompute_granularity, tokens_per_microbatch=int(tokens),
                   vocab_divisible_by=int(cfg.model.make_vocab_size_divisible_by),
                   num_layers_first=p.num_layers_in_first_pipeline_stage,
                   num_layers_last=p.num_layers_in_last_pipeline_stage)


@dataclass
class RankMemory:
    """Bytes per consumer on one rank (insertion order = report order)."""

    consumers: dict[str, int] = field(default_factory=dict)
    params: int = 0
    """Parameters held by the rank."""
    stage: int = 0
    """Pipeline stage (trainer) of this rank."""

    @property
    def total(self) -> int:
        """Bytes of all consumers together."""
        return sum(self.consumers.values())

    def largest(self) -> tuple[str, int]:
        """The consumer holding the most bytes."""
        return max(self.consumers.items(), key=lambda kv: kv[1])


def stage_layers(num_layers: int, s: TrainerSetup) -> list[range]:
    """Layer indices of each pipeline stage (even split; Megatron's first / last stage overrides)."""
    first, last = s.num_layers_first, s.num_layers_last
    inner = s.pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    sizes = [rest // inner + (1 if i < rest % inner else 0) for i in range(inner)] if inner > 0 else []
    sizes = ([first] if first is not None else []) + sizes + ([last] if last is not None else [])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def trainer_stage_params(shape: ModelShape, s: TrainerSetup, layers: range, *, first: bool,
                         last: bool) -> tuple[float, float]:
    """``(dense, expert)`` parameters one rank of a stage holds (see module docstring)."""
    split, rep = shape.attention_params()
    experts, shared, router = shape.moe_params()
    dense = expert = 0.0
    for i in layers:
        dense += split / s.tp + rep
        if shape.moe_layers[i]:
            dense += shared / s.tp + router
            expert += experts / (s.ep * s.etp)
        else:
            dense += shape.dense_mlp_params() / s.tp
    vocab = shape.padded_vocab(s.vocab_divisible_by, s.tp) * shape.hidden_size / s.tp
    dense += vocab * (first + (last and (not shape.tie_embeddings or s.pp > 1)))
    dense += shape.hidden_size if last else 0
    return dense, expert


def layer_activation_bytes(shape: ModelShape, moe: bool, a: int) -> float:
    """Bytes one layer keeps per token for backward without recompute (module docstring), before TP."""
    h, n = shape.hidden_size, shape.num_attention_heads
    if shape.mla:
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        attn = 2 * h + shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim \
            + n * qk * 2 + n * shape.v_head_dim * 2
    else:
        q, kv = n * shape.head_dim, shape.num_kv_heads * shape.head_dim
        attn = 2 * h + 2 * q + 2 * kv
    if moe:
        k, f = shape.topk, shape.moe_ffn_hidden_size
        mlp = a * (2 * h + 2 * k * h + 3 * k * f + 3 * shape.shared_ffn_hidden_size) + 8 * shape.num_experts
        return a * attn + mlp
    return a * (attn + 2 * h + 3 * shape.ffn_hidden_size)


def trainer_rank_memory(shape: ModelShape, s: TrainerSetup, stage: int) -> RankMemory:
    """Bytes on one rank of pipeline stage ``stage`` (module docstring), by consumer."""
    stages = stage_layers(shape.num_layers, s)
    first, last = stage == 0, stage == s.pp - 1
    dense, expert = trainer_stage_params(shape, s, stages[stage], first=first, last=last)
    dense_shards = s.dp * s.cp if s.distributed_optimizer else 1
    expert_shards = s.expert_dp if s.distributed_optimizer else 1
    main = 4 if s.param_bytes < 4 else 0
    states = 8 if s.optimizer == "adam" else 0
    a = s.param_bytes
    tokens = s.tokens_per_microbatch / s.cp / (s.tp if (s.sequence_parallel or s.tp == 1) else 1)
    layers = stages[stage]
    stored = [layer_activation_bytes(shape, shape.moe_layers[i], a) for i in layers]
    if s.recompute == "full":
        per_mb = len(layers) * a * shape.hidden_size + max(stored, default=0)
    else:
        per_mb = sum(stored) + (4 * shape.num_attention_heads / s.tp * len(layers) if s.recompute is None else 0)
    in_flight: float = 1
    if first and s.pp > 1:
        in_flight = s.pp * (1 + (s.pp - 1) / (s.pp * s.vpp)) if s.vpp else s.pp
    activations = tokens * per_mb * in_flight
    if first:
        activations += tokens * a * shape.hidden_size * in_flight  # the embedding's output
    consumers = {
        "weights": int((dense + expert) * s.param_bytes),
        "gradients": int((dense + expert) * 4),
        "main_weights": int(main * (dense / dense_shards + expert / expert_shards)),
        "adam_states": int(states * (dense / dense_shards + expert / expert_shards)),
        "activations": int(activations),
        "logits": int(s.tokens_per_microbatch / s.cp * shape.padded_vocab(s.vocab_divisible_by, s.tp) / s.tp * 6)
        if last else 0,  # [T / CP, V / TP]: the output layer all-gathers the sequence-parallel input
        "dispatch_buffers": int(2 * shape.topk * tokens * shape.hidden_size * a) if any(shape.moe_layers) else 0,
        "reserved": RESERVED_BYTES,
    }
    return RankMemory(consumers, params=int(dense + expert), stage=stage)


def trainer_memory(shape: ModelShape, s: TrainerSetup) -> RankMemory:
    """The most loaded trainer rank (the stage with the largest total)."""
    return max((trainer_rank_memory(shape, s, stage) for stage in range(s.pp)), key=lambda m: m.total)


@dataclass(frozen=True)
class EngineSetup:
    """One SGLang engine's layout and memory settings."""

    tp: int
    ep: int = 1
    fp8: bool = False
    """Block-FP8 weights (the checkpoint's ``quantization_config``)."""
    weight_bytes: int = 2
    """Bytes per element of unquantised weights (``rollout.engine.dtype``; 2 for auto / bf16)."""
    mem_fraction_static: float = 0.8
    max_total_tokens: int | None = None
    """SGLang ``--max-total-tokens``: a cap on the KV pool's tokens (None: none)."""


@dataclass
class EngineMemory:
    """One engine rank: weight bytes, KV-cache bytes per token, and the tokens of context that fit."""

    weights: int
    kv_per_token: int
    kv_pool: int
    tokens_fit: int


def engine_memory(shape: ModelShape, e: EngineSetup, memory_bytes: int) -> EngineMemory:
    """Per engine rank (module docstring); ``memory_bytes`` is one GPU's memory."""
    split, rep = shape.attention_params()
    experts, shared, router = shape.moe_params()
    linear = norms = 0.0
    for moe in shape.moe_layers:
        linear += split / e.tp + (rep - shape.hidden_size)
        norms += shape.hidden_size
        if moe:
            linear += (experts + shared) / e.tp
            norms += router
        else:
            linear += (shape.dense_mlp_params() - shape.hidden_size) / e.tp
    one_copy = shape.tie_embeddings and not shape.engine_own_lm_head  # else lm_head apart from the embedding
    vocab = shape.vocab_size * shape.hidden_size / e.tp * (1 if one_copy else 2)
    linear_bytes = (1 + 4 / FP8_BLOCK ** 2) if e.fp8 else e.weight_bytes
    weights = int(linear * linear_bytes + (vocab + norms) * (2 if e.fp8 else e.weight_bytes))
    if shape.mla:
        kv = (shape.kv_lora_rank + shape.qk_rope_head_dim) * shape.num_layers * 2
    else:
        kv = 2 * max(1, shape.num_kv_heads // e.tp) * shape.head_dim * shape.num_layers * 2
    pool = int(e.mem_fraction_static * memory_bytes) - weights
    tokens = max(pool, 0) // kv
    if e.max_total_tokens is not None:
        tokens = min(tokens, int(e.max_total_tokens))
    return EngineMemory(weights, kv, pool, tokens)
