"""The typed configuration schema of megarl.

One dataclass per section of docs/architecture.md, used as an OmegaConf structured config: YAML files and
``key.sub=value`` overrides are merged onto these defaults, unknown keys and wrong types are errors
(see :mod:`megarl.config.loader`), and cross-field checks live in :func:`megarl.config.validate.validate`.

Parallel and model fields use Megatron-Core's names. Model *architecture* (layers, heads, experts,
hidden sizes, rope) is never typed here: it is read from the Hugging Face ``config.json`` under
``model.hf_path``.

Defaults are the paper defaults of GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence-level
importance ratio, clip range 3e-4 / 4e-4, no KL penalty, group-normalised advantages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from megarl.config.schema_algorithm import AlgorithmConfig
from megarl.config.schema_rollout import AgentConfig, EngineConfig, RetrievalConfig, RolloutConfig, SamplingConfig  # noqa: F401  (part of this module's interface)


@dataclass
class ModelConfig:
    """The policy model. Architecture comes from ``{hf_path}/config.json``."""

    hf_path: str = "???"
    """Hugging Face model directory (config.json, tokenizer files, safetensors weights)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to ``hf_path``."""
    load_weights: bool = True
    """Load the HF weights into the trainer at start (False: random init, for tests and benchmarks)."""
    load_dir: str | None = None
    """Megatron dist checkpoint the trainer starts from instead of ``hf_path``'s safetensors: the
    output of ``megarl convert hf-to-megatron`` (any parallel layout, precision and vocabulary
    padding) or a trainer checkpoint ``RUN/checkpoints/step_N`` (model weights only; optimizer and
    step start fresh). ``hf_path`` still gives the architecture, tokenizer and the engines' launch
    weights (the trainer's weights are pushed to the engines before the first rollout). Ignored when
    ``checkpoint.resume`` finds a checkpoint: resume wins. ``megarl validate`` checks it holds
    ``hf_path``'s model."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tensor_model_parallel_size."""
    moe_router_dtype: str | None = "fp32"
    """Router logits dtype: ``fp32`` (default, recommended for RL), ``fp64`` or None (model dtype)."""
    moe_aux_loss_coeff: float = 0.0
    """Auxiliary load-balancing loss coefficient; 0 (off) by default for RL."""
    moe_router_freeze: bool = False
    """Freeze the router weights (no gradient step on them)."""
    moe_token_dispatcher_type: str = "alltoall"
    """Megatron MoE token dispatcher: ``alltoall`` or ``allgather``."""
    moe_grouped_gemm: bool | None = None
    """Grouped GEMM for experts; None = on with CUDA/Transformer Engine, off on CPU."""
    recompute_granularity: str | None = None
    """Activation recomputation: None, ``selective`` or ``full`` (Megatron's names)."""
    megatron_overrides: dict[str, Any] = field(default_factory=dict)
    """Any Megatron-Core ``TransformerConfig`` or ``DistributedDataParallelConfig`` field, applied
    last over megarl's choices (``{moe_permute_fusion: false, bucket_size: 40000000}``); names are
    checked against Megatron's own dataclass fields by ``megarl validate``."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (0 for RL)."""
    hidden_dropout: float = 0.0
    """Dropout on hidden states (0 for RL)."""


@dataclass
class ParallelConfig:
    """Trainer parallelism, in Megatron-Core's names. DP size is derived: world / (TP*PP*CP)."""

    tensor_model_parallel_size: int = 1
    """Tensor (intra-layer) model-parallel size (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline model-parallel size (PP): the layers are split into this many stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline: model chunks per PP stage (None = no interleaving)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size (EP): the experts are split over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside each expert (ETP); None = Megatron's default (equal to TP)."""
    context_parallel_size: int = 1
    """Context-parallel size (CP): the sequence is split over this many ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (requires TP > 1; required for MoE with TP > 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Uneven pipeline: decoder layers on the first stage (Megatron's field); None = even split."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Uneven pipeline: decoder layers on the last stage; the middle stages share the rest evenly
    (DeepSeek-V3's 61 layers on PP=8: first 7, last 6, six middle stages of 8)."""


@dataclass
class TrainConfig:
    """Policy optimisation: steps, batches, optimizer, precision."""

    num_steps: int = 100
    """RL steps (rollout -> train -> weight sync), i.e. policy versions to produce."""
    global_batch_size: int = 64
    """Trajectories per optimizer step. The trajectories of one RL step are split into
    ``num_trajectories / global_batch_size`` optimizer steps."""
    micro_batch_size: int = 1
    """Sequences per micro batch when ``max_tokens_per_microbatch`` is unset."""
    max_tokens_per_microbatch: int | None = 4096
    """Token budget per micro batch (dynamic batching); None = fixed ``micro_batch_size``."""
    optimizer: str = "adam"
    """``adam`` (AdamW) or ``sgd``."""
    lr: float = 1.0e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.98
    """Adam beta2."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    precision: str = "auto"
    """Parameter / compute dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``bf16``, ``fp16`` or ``fp32``."""
    fp8: str | None = None
    """FP8 through Transformer Engine (GPU only): None, ``e4m3`` or ``hybrid``."""
    fp8_recipe: str = "tensorwise"
    """Transformer Engine FP8 recipe: ``tensorwise`` (current per-tensor scaling, sm_89+),
    ``blockwise`` (sm_90, torch with CUDA 12.9+), ``mxfp8`` (sm_100) or ``delayed`` (amax history:
    the old-logprob pass and the training forward quantise differently, so GSPO rejects it)."""
    routing_replay: str = "none"
    """MoE routing replay: ``none``; ``r2`` (replay routes recorded in the old-logprob pass);
    ``r3`` (replay the rollout engine's routes, Rollout Routing Replay, arXiv:2510.11370)."""
    seed: int = 1234
    """Seed of the trainer, the data order and the rollout sampling."""
    max_wall_time_s: float | None = None
    """Stop cleanly before this many seconds of ``megarl train``: after the step whose successor
    would not fit, save a checkpoint and exit with code 75 (as on SIGUSR1 / SIGTERM); None = no limit."""


@dataclass
class WeightSyncConfig:
    """Trainer -> engine weight transfer after optimizer steps."""

    transport: str = "auto"
    """``auto`` (``p2p`` where it applies, else ``distributed``; ``tensor`` for colocated engines on
    CUDA; see ``megarl.weight_sync.choice.resolve_auto``), ``distributed`` (process group with
    the engines, every engine rank receives whole tensors), ``p2p`` (each engine rank
    receives exactly its shard over a process group, any host), ``shard`` (per-rank payloads, same
    host), ``tensor`` (colocated, whole tensors), ``disk`` (safetensors + reload), a name a plugin
    registered, or an import path ``module:Class`` (``megarl.config.sync_transports``)."""
    bucket_size_mb: int = 512
    """Bucket size for flattened transfers, in MiB. Also the engine's receive memory during a sync:
    with owner senders (``senders: owner``/``auto`` disaggregated) an engine rank receives about
    ``0.8 * bucket_size_mb`` per round and holds two rounds, ~1.6x this per engine rank
    (``megarl.weight_sync.senders.plan_rounds``)."""
    senders_per_stage: int | None = None
    """``p2p`` / ``distributed`` with several engines: this many complete copies (data-parallel
    replicas) of each pipeline stage gather and send side by side, replica ``k`` to the engines
    ``i % senders_per_stage == k``; null = as many as there are engines and complete copies
    (``megarl.weight_sync.plan``); 1 = one sender per stage. ``shard``/``tensor``/``disk`` use 1."""
    senders: str = "auto"
    """Which trainer ranks send with ``p2p``: ``auto`` (the default: ``owner`` in a disaggregated run
    whose transport is ``p2p`` or ``auto``, which then runs ``p2p``, where SGLang loads every tensor
    pre-sharded at the engine layout and, with ``auto``, the engines registered megarl's receiver;
    else ``segment``; ``megarl.weight_sync.synchronizer_build.build_weight_sync``), ``owner`` (every
    rank sends its own parts, nothing gathered, all pipeline stages at once into one update request
    per engine; ``transport: p2p``, BF16 or block-FP8 engines; ``megarl.weight_sync.owners``),
    ``segment`` (each engine rank's segment from the stage rank holding most of it, stages one
    after another; ``megarl.weight_sync.segments``), ``stage`` (the stage sender gathers and sends
    everything)."""
    backend: str = "auto"
    """Collective backend for the distributed transport: ``auto`` (nccl on GPU, gloo on CPU)."""
    pause_mode: str = "retract"
    """How generation is paused for the update: ``retract``, ``abort`` or ``in_place``. With
    ``train.routing_replay: r3`` and ``rollout.async_mode``, ``abort`` only: the others cannot keep the
    routes tokens were sampled with (docs/architecture.md, "R3 across a weight update")."""
    every_n_steps: int = 1
    """Sync after every N RL steps (async mode may use N > 1)."""
    verify: str = "first"
    """Check engine logprobs against the trainer after a sync: ``off``, ``first`` (the first sync
    of a connection and the first that changed the engines' weights,
    ``megarl.launch.weight_sync_stage.verify_now``), ``always``."""
    verify_tolerance: float = 1.0e-2
    """Max allowed mean absolute logprob difference in verification, BF16 trainer vs BF16 engine;
    ``megarl.training.fp8.verify_tolerance`` widens it for an FP8 trainer (``train.fp8``) and for
    engines serving a block-FP8 checkpoint."""
    timeout_s: float = 600.0
    """Seconds before a sync is declared failed."""
    load_proof: str = "every_sync"
    """``p2p``: after loading each bucket the engines read it back from their parameters
    (``megarl.weight_sync.load_proof``; parameters SGLang transforms are skipped, named): ``every_sync``,
    ``verified_syncs`` (the syncs ``verify`` checks), ``off``."""


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_path: str = "???"
    """Training prompts (jsonl or parquet)."""
    eval_path: str | None = None
    """Held-out prompts for evaluation."""
    dataset: str = "file"
    """Reader of ``train_path`` / ``eval_path``: ``file`` (jsonl or parquet), or a reader a plugin
    registers / an import path: ``reader(path, **dataset_kwargs) -> list of row dicts``."""
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the dataset reader."""
    prompt_key: str = "question"
    """Field holding the prompt text."""
    answer_key: str = "answer"
    """Field holding the reference answer (given to the reward)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the chat template) are skipped."""
    shuffle: bool = True
    """Shuffle the prompt order every epoch (seeded by ``train.seed``)."""
    max_eval_samples: int | None = 64
    """Evaluate on at most this many held-out prompts."""
    eval_interval: int = 0
    """Evaluate every N RL steps (0 = never); greedy decoding (``eval/accuracy``)."""
    eval_samples_per_prompt: int = 0
    """Also sample this many trajectories per held-out prompt at the training sampling settings
    and report their mean reward ``eval/sampled_reward_mean`` and accuracy
    ``eval/sampled_accuracy`` (the policy's expected held-out reward, mean@k: what RL maximises);
    0 = greedy only."""


@dataclass
class ClusterConfig:
    """Placement of trainer and rollout processes (Ray)."""

    device: str = "auto"
    """``auto`` (cuda when available), ``cuda`` or ``cpu``."""
    placement: str = "disaggregated"
    """``disaggregated`` (separate trainer and rollout devices) or ``colocated`` (shared)."""
    trainer_nodes: int = 1
    """Nodes for the trainer."""
    trainer_devices_per_node: int = 1
    """GPUs (CPU: processes) per trainer node; trainer world size = nodes x devices."""
    rollout_nodes: int = 1
    """Nodes for the rollout engines (disaggregated)."""
    rollout_devices_per_node: int = 1
    """GPUs (CPU: engine ranks) per rollout node."""
    gpu: str | None = None
    """GPU model for capacity planning (`megarl.plan.gpus`): ``h100``, ``h200``, ``b200``, ``gb200``, or
    ``auto`` (this node's, by ``torch.cuda.get_device_name``); None: unknown (with ``device: cuda``
    the node's GPU is detected). When known, ``megarl validate`` refuses a layout whose trainer or
    engine ranks do not fit its memory (``megarl plan`` shows the numbers); CPU runs skip the check."""
    ray_address: str | None = None
    """Existing Ray cluster (``auto`` or ``host:port``); None = start a private local one (never one
    that ``RAY_ADDRESS`` or an earlier ``ray start`` on the machine names: give ``auto`` for that)."""
    master_port: int = 0
    """torch.distributed rendezvous port of the trainer group on rank 0's node: the first free port at
    or above it there, within 1000 ports (the range a firewalled cluster opens); 0 (default): a free
    port below the kernel's ephemeral range. Ports handed out are reserved on the node for a while, so
    two runs started at once on one machine do not race for one (``megarl.rollout.engine_resources``)."""
    colocated_trainer_memory_fraction: float = 0.4
    """Colocated on CUDA: the share of each GPU's memory the trainer rank keeps while the engines hold
    theirs (rollout and weight sync): its parameters, gradients, optimizer states and allocator
    cache. ``megarl validate`` checks that ``rollout.engine.mem_fraction_static`` + this fits."""
    colocated_offload: str = "none"
    """Colocated on CUDA, while the engines hold their memory: ``none``, ``optimizer`` (main weights, Adam states
    to the host) or ``optimizer_and_grads`` (and the gradient buffers freed); ``megarl.training.memory_limit``."""
    distributed_timeout_minutes: int = 30
    """Timeout of the trainer's ``torch.distributed`` groups (the default group and Megatron's): a
    collective that waits longer raises instead of hanging."""
    trainer_setup_timeout_s: float = 900.0
    """Seconds every trainer rank may take to start and build its model, DDP and optimizer."""
    trainer_call_timeout_s: float = 1200.0
    """Seconds one trainer call (old logprobs, a train step, a weight sync, a checkpoint) may take on
    every rank before the group is killed and the run stops."""


@dataclass
class CheckpointConfig:
    """Trainer checkpoints and resume."""

    save_dir: str | None = None
    """Where checkpoints go; None = ``{logging.run_dir}/checkpoints``."""
    save_interval: int = 0
    """Save every N RL steps (0 = only at the end)."""
    resume: bool = False
    """Resume from the newest checkpoint under ``save_dir``."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0 = all)."""
    hf_export_interval: int = 0
    """Also export a Hugging Face checkpoint every N steps to ``{run_dir}/hf/step_N`` (0 = never), in
    the background while training goes on (``megarl.launch.hf_export``)."""


@dataclass
class LoggingConfig:
    """Run directory and metric sinks."""

    run_dir: str = "runs/megarl"
    """Run outputs: resolved config, logs, metrics, plots, checkpoints."""
    tensorboard: bool = True
    """Write TensorBoard event files under ``run_dir/tensorboard``."""
    jsonl: bool = True
    """Append one JSON line of metrics per step to ``run_dir/metrics.jsonl``."""
    wandb: bool = False
    """Log to Weights & Biases (needs ``pip install wandb``)."""
    wandb_project: str = "megarl"
    """W&B project."""
    progress_bar: bool = True
    """Show a progress bar on the console."""
    plots: bool = True
    """Save reward and mismatch curves as PNG at the end."""
    save_rollouts: bool = True
    """Write every step's trajectories (decoded prompt and response, token counts, tool calls,
    reward and its terms, policy version, group id) to ``run_dir/rollouts/step_N.jsonl``."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one trainer device for ``perf/mfu`` (default: looked up by GPU name,
    ``megarl.launch.mfu.PEAK_TFLOPS``; a CPU or unknown GPU logs NaN)."""
    level: str = "INFO"
    """Python logging level."""


@dataclass
class SFTConfig:
    """Supervised cold start before RL (as in ReTool): masked NLL on tool-use demonstrations, same trainer."""

    num_steps: int = 0
    """Optimizer steps of SFT before the first RL step (0 = no cold start). Skipped when resuming."""
    demonstrations: str = "gsm8k_python"
    """A jsonl/parquet file whose rows hold chat ``messages``, or a builder turning the rows of
    ``data.train_path`` into demonstrations: a registered name (``gsm8k_python``: python-tool
    demonstrations from GSM8K's worked solutions; plugins add theirs with
    ``megarl.data.demonstrations.register_demonstrations``) or an import path ``module:attr`` / ``file.py:attr``
    (e.g. ``examples/arithmetic_tool/task.py:demonstrations``), called as
    ``builder(rows, *, system_prompt, tool_fraction, seed)``."""
    batch_size: int = 16
    """Demonstrations per SFT optimizer step."""
    lr: float = 1.0e-3
    """Learning rate of the SFT steps (RL then continues with ``train.lr``)."""
    tool_fraction: float = 1.0
    """Builders only: fraction of demonstrations that call the tool; the rest answer directly."""
    max_demonstrations: int = 4096
    """Use at most this many demonstrations."""


@dataclass
class MegarlConfig:
    """The whole run. Sections as in docs/architecture.md."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    plugins: list[str] = field(default_factory=list)
    """User modules (dotted names or ``.py`` files) imported before anything is built, in the
    driver and in every Ray worker; they register tools, rewards, agent loops and datasets."""
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)


def as_megarl_config(cfg: Any) -> MegarlConfig:
    """``cfg`` typed as the schema: a ``DictConfig`` with :class:`MegarlConfig`'s sections (the loader's
    structured config, or a resolved config read back from YAML, as the Ray actors do), or a
    ``MegarlConfig``. OmegaConf types its configs as ``DictConfig``; their attributes are the schema's.
    ``cfg`` itself is returned: nothing is copied or validated.

    Raises:
        TypeError: ``cfg`` is neither (a ``ListConfig``, a plain dict).
    """
    from omegaconf import DictConfig

    if not isinstance(cfg, (DictConfig, MegarlConfig)):
        raise TypeError(f"a run config must be a DictConfig of MegarlConfig, got {type(cfg).__name__}")
    return cast(MegarlConfig, cfg)
