"""The declared domain of every scalar field of the schema, and of the built-in tools' and rewards' settings.

One table, :data:`DOMAINS`, keyed by dotted field name: an enum field names its values
(:class:`Choice`), a field that selects an extension (policy loss, advantage estimator, rollout
correction, reward, agent loop, dataset, weight-sync transport) its registry (:class:`Registered`: the registry's names,
read when a value is checked, or an import path), a number its range (:class:`Range`), a free string
what it holds and who checks it (:class:`Text`). ``megarl validate`` checks every value against its domain
(:func:`megarl.config.validate.validate`); a test walks the schema and fails on a field missing here,
so a new field cannot ship without one. None is allowed exactly where the schema types a field
``Optional`` (OmegaConf refuses it elsewhere), so a domain never lists it except as a documented value.

Free dict sections are typed by the code they configure: ``rollout.tools.<name>`` by the built-in
tool's constructor (:data:`TOOL_DOMAINS`, by registry name) and ``rollout.reward_kwargs`` by the
built-in reward's (:data:`REWARD_DOMAINS`, applied when ``rollout.reward`` names it). A tool or reward
named by import path, or registered by a plugin, is checked by its own constructor at build time.
Rules that relate several fields (batch divisibility, the GSPO clip size) stay in
:mod:`megarl.config.validate`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.plan.gpus import CHOICES as GPU_CHOICES
from megarl.registry import Registry


@dataclass(frozen=True)
class Choice:
    """An enum: the value must be one of ``values``."""

    values: tuple

    def allows(self, value: Any) -> bool:
        """True when ``value`` is one of :attr:`values`."""
        return value in self.values

    def __str__(self) -> str:
        return f"one of {', '.join(map(repr, self.values))}"


@dataclass(frozen=True)
class Range:
    """A number in ``[low, high]`` (``bounds``: ``[``/``(`` and ``]``/``)``, closed / open; None =
    unbounded), or one of the special values ``also`` (``top_k: -1`` = off)."""

    low: float | None = None
    high: float | None = None
    bounds: str = "[]"
    also: tuple = ()

    def allows(self, value: Any) -> bool:
        """True when ``value`` is a finite number (not a bool) inside the range, or one of :attr:`also`."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if value in self.also:
            return True
        if math.isnan(value):
            return False
        if self.low is not None and (value < self.low or (self.bounds[0] == "(" and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.bounds[1] == ")" and value == self.high)))

    def __str__(self) -> str:
        low = "(-inf" if self.low is None else f"{self.bounds[0]}{self.low:g}"
        high = "inf)" if self.high is None else f"{self.high:g}{self.bounds[1]}"
        extra = "".join(f" or {v!r}" for v in self.also)
        return f"in {low}, {high}{extra}"


@dataclass(frozen=True)
class Text:
    """A free string; ``what`` says what it holds and where it is checked (paths, registry names)."""

    what: str

    def allows(self, value: Any) -> bool:
        """Always True: a free string's content is checked where it is used (``what``)."""
        return True

    def __str__(self) -> str:
        return self.what


@dataclass(frozen=True)
class Registered:
    """A name registered in an extension point's registry, or an import path ``module:attr``, or
    one of ``also`` (``none``). The registry is read when a value is checked, so a name a plugin
    registers is a valid choice without an entry here; whether an import path loads and fits is
    checked with the rest of the user code (:mod:`megarl.config.plugin_check`)."""

    registry: Callable[[], Registry]
    """Returns the registry (imported on first use: the registries import torch and the rollout stack)."""
    also: tuple = ()

    def allows(self, value: Any) -> bool:
        """True when ``value`` is one of :attr:`also`, registered, or shaped as an import path."""
        return value in self.also or self.registry().allows(value)

    def __str__(self) -> str:
        return "".join(f"{v!r} or " for v in self.also) + self.registry().describe()


def _policy_losses() -> Registry:
    from megarl.algorithms.extensions import POLICY_LOSSES
    return POLICY_LOSSES


def _advantage_estimators() -> Registry:
    from megarl.algorithms.extensions import ADVANTAGE_ESTIMATORS
    return ADVANTAGE_ESTIMATORS


def _rollout_corrections() -> Registry:
    from megarl.algorithms.extensions import ROLLOUT_CORRECTIONS
    return ROLLOUT_CORRECTIONS


def _transports() -> Registry:
    from megarl.config.sync_transports import TRANSPORTS
    return TRANSPORTS


def _rewards() -> Registry:
    from megarl.rollout.rewards.reward_registry import REWARD_REGISTRY
    return REWARD_REGISTRY


def _agent_loops() -> Registry:
    from megarl.rollout.agent import AGENT_REGISTRY
    return AGENT_REGISTRY


def _datasets() -> Registry:
    from megarl.data.datasets import DATASET_REGISTRY
    return DATASET_REGISTRY


Domain = Choice | Registered | Range | Text

POSITIVE = Range(1)
"""An integer count or size that must be at least 1."""
NON_NEGATIVE = Range(0)
"""A count, interval or coefficient where 0 means off."""
SECONDS = Range(0, None, "()")
"""A timeout or limit in seconds: positive."""
FRACTION = Range(0, 1, "()")
"""A share strictly between 0 and 1."""
PORT = Range(0, 65535)
"""A TCP port; 0 = any free one."""
PROBABILITY = Range(0, 1, "[)")
"""A dropout probability or an Adam beta."""

DOMAINS: dict[str, Domain] = {
    "model.hf_path": Text("a Hugging Face model directory or hub id (checked: config.json, megarl.config.hub)"),
    "model.tokenizer_path": Text("a tokenizer directory (checked: exists)"),
    "model.load_dir": Text("a Megatron dist checkpoint (checked: megarl.conversion.load_dir)"),
    "model.make_vocab_size_divisible_by": POSITIVE,
    "model.moe_router_dtype": Choice((None, "fp32", "fp64")),
    "model.moe_aux_loss_coeff": NON_NEGATIVE,
    "model.moe_token_dispatcher_type": Choice(("alltoall", "allgather")),
    "model.recompute_granularity": Choice((None, "selective", "full")),
    "model.attention_dropout": PROBABILITY,
    "model.hidden_dropout": PROBABILITY,
    "parallel.tensor_model_parallel_size": POSITIVE,
    "parallel.pipeline_model_parallel_size": POSITIVE,
    "parallel.virtual_pipeline_model_parallel_size": Range(2),  # >= 2 chunks per stage, or null
    "parallel.expert_model_parallel_size": POSITIVE,
    "parallel.expert_tensor_parallel_size": POSITIVE,
    "parallel.context_parallel_size": POSITIVE,
    "parallel.num_layers_in_first_pipeline_stage": POSITIVE,
    "parallel.num_layers_in_last_pipeline_stage": POSITIVE,
    "train.num_steps": POSITIVE,
    "train.global_batch_size": POSITIVE,
    "train.micro_batch_size": POSITIVE,
    "train.max_tokens_per_microbatch": POSITIVE,
    "train.optimizer": Choice(("adam", "sgd")),
    "train.lr": NON_NEGATIVE,
    "train.min_lr": NON_NEGATIVE,
    "train.lr_warmup_steps": NON_NEGATIVE,
    "train.lr_decay_style": Choice(("constant", "linear", "cosine")),
    "train.weight_decay": NON_NEGATIVE,
    "train.adam_beta1": PROBABILITY,
    "train.adam_beta2": PROBABILITY,
    "train.adam_eps": Range(0, None, "()"),
    "train.clip_grad": NON_NEGATIVE,
    "train.precision": Choice(("auto", "bf16", "fp16", "fp32")),
    "train.fp8": Choice((None, "e4m3", "hybrid")),
    "train.fp8_recipe": Choice(("delayed", "tensorwise", "blockwise", "mxfp8")),
    "train.routing_replay": Choice(("none", "r2", "r3")),
    "train.seed": NON_NEGATIVE,
    "train.max_wall_time_s": SECONDS,
    "algorithm.policy_loss": Registered(_policy_losses),
    "algorithm.advantage_estimator": Registered(_advantage_estimators),
    "algorithm.clip_low": FRACTION,  # GSPO's smaller bound: its registry entry (megarl.config.algorithm_rules)
    "algorithm.clip_high": FRACTION,
    "algorithm.clip_c": Range(1, None, "()"),  # only losses declaring it: megarl.config.algorithm_rules
    "algorithm.loss_aggregation": Choice(("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                          "seq_mean_token_sum_norm")),
    "algorithm.advantage_eps": Range(0, None, "()"),
    "algorithm.kl_coef": NON_NEGATIVE,
    "algorithm.kl_estimator": Choice(("k1", "k2", "k3")),
    "algorithm.entropy_coef": NON_NEGATIVE,
    "algorithm.rollout_correction": Registered(_rollout_corrections, also=("none",)),
    "algorithm.rollout_correction_level": Choice(("token", "sequence")),
    "algorithm.rollout_correction_clip": Range(1),
    "algorithm.rollout_correction_low": Range(0, 1),
    "algorithm.max_behaviour_drift": Range(0, None, "()"),  # null = off
    "algorithm.behaviour_drift_statistic": Choice(("k3_mean", "log_ratio_abs_mean", "log_ratio_abs_max")),
    "rollout.num_engines": POSITIVE,
    "rollout.group_size": POSITIVE,
    "rollout.num_prompts_per_step": POSITIVE,
    "rollout.over_sample_prompts": NON_NEGATIVE,
    "rollout.reward": Registered(_rewards),
    "rollout.max_staleness": NON_NEGATIVE,  # async mode needs >= 1: validate._check_algorithm
    "rollout.engine.tensor_parallel_size": POSITIVE,
    "rollout.engine.expert_parallel_size": POSITIVE,
    "rollout.engine.host": Text("auto, or an address the engine binds"),
    "rollout.engine.base_port": Range(1, 65535),
    "rollout.engine.mem_fraction_static": FRACTION,
    "rollout.engine.max_total_tokens": POSITIVE,
    "rollout.engine.startup_timeout_s": SECONDS,
    "rollout.engine.request_timeout_s": SECONDS,
    "rollout.engine.dtype": Choice(("auto", "half", "float16", "bfloat16", "float", "float32")),  # SGLang --dtype
    "rollout.engine.grammar_backend": Choice(("xgrammar", "outlines", "llguidance", "none")),  # SGLang 0.5.23
    "rollout.sampling.temperature": NON_NEGATIVE,
    "rollout.sampling.top_p": Range(0, 1, "(]"),
    "rollout.sampling.top_k": Range(1, also=(-1,)),  # -1 = off (SGLang)
    "rollout.sampling.max_new_tokens": POSITIVE,
    "rollout.agent.name": Registered(_agent_loops),
    "rollout.agent.max_turns": POSITIVE,
    "rollout.agent.max_response_tokens": POSITIVE,
    "rollout.agent.max_context_tokens": POSITIVE,
    "rollout.agent.system_prompt": Text("a system message"),
    "rollout.agent.tool_call_parser": Text("auto, or an SGLang FunctionCallParser name (checked: "
                                           "megarl.rollout.reasoning.parser_issues)"),
    "rollout.agent.reasoning_parser": Text("auto, none, or an SGLang ReasoningParser name (checked: "
                                           "megarl.rollout.reasoning.parser_issues)"),
    "rollout.agent.max_tool_output_chars": POSITIVE,
    "rollout.agent.tool_timeout_s": SECONDS,
    "weight_sync.transport": Registered(_transports, also=("auto",)),
    "weight_sync.bucket_size_mb": POSITIVE,
    "weight_sync.senders_per_stage": POSITIVE,
    "weight_sync.senders": Choice(("auto", "owner", "segment", "stage")),
    "weight_sync.backend": Choice(("auto", "nccl", "gloo")),
    "weight_sync.pause_mode": Choice(("retract", "abort", "in_place")),
    "weight_sync.every_n_steps": POSITIVE,
    "weight_sync.verify": Choice(("off", "first", "always")),
    "weight_sync.load_proof": Choice(("every_sync", "verified_syncs", "off")),
    "cluster.colocated_offload": Choice(("none", "optimizer", "optimizer_and_grads")),
    "weight_sync.verify_tolerance": Range(0, None, "()"),
    "weight_sync.timeout_s": SECONDS,
    "data.train_path": Text("a jsonl/parquet file, or what data.dataset reads (checked: exists for dataset=file)"),
    "data.eval_path": Text("a jsonl/parquet file, or what data.dataset reads (checked: exists for dataset=file)"),
    "data.dataset": Registered(_datasets),
    "data.prompt_key": Text("a field of the prompt rows"),
    "data.answer_key": Text("a field of the prompt rows"),
    "data.max_prompt_tokens": POSITIVE,
    "data.max_eval_samples": POSITIVE,
    "data.eval_interval": NON_NEGATIVE,
    "data.eval_samples_per_prompt": NON_NEGATIVE,
    "cluster.device": Choice(("auto", "cuda", "cpu")),
    "cluster.placement": Choice(("disaggregated", "colocated")),
    "cluster.trainer_nodes": POSITIVE,
    "cluster.trainer_devices_per_node": POSITIVE,
    "cluster.rollout_nodes": POSITIVE,
    "cluster.rollout_devices_per_node": POSITIVE,
    "cluster.gpu": Choice(GPU_CHOICES),
    "cluster.ray_address": Text("auto, or host:port of a running Ray cluster"),
    "cluster.master_port": PORT,
    "cluster.colocated_trainer_memory_fraction": FRACTION,
    "cluster.distributed_timeout_minutes": POSITIVE,
    "cluster.trainer_setup_timeout_s": SECONDS,
    "cluster.trainer_call_timeout_s": SECONDS,
    "checkpoint.save_dir": Text("a directory"),
    "checkpoint.save_interval": NON_NEGATIVE,
    "checkpoint.keep_last": NON_NEGATIVE,
    "checkpoint.hf_export_interval": NON_NEGATIVE,
    "logging.run_dir": Text("a directory"),
    "logging.wandb_project": Text("a Weights & Biases project name"),
    "logging.peak_tflops": Range(0, None, "()"),
    "logging.level": Choice(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),  # Python logging's names
    "sft.num_steps": NON_NEGATIVE,
    "sft.demonstrations": Text("a jsonl/parquet file or a builder (checked: megarl.config.plugin_check)"),
    "sft.batch_size": POSITIVE,
    "sft.lr": NON_NEGATIVE,
    "sft.tool_fraction": Range(0, 1),
    "sft.max_demonstrations": POSITIVE,
    "retrieval.index": Text("an index directory (megarl index build; checked at start)"),
    "retrieval.backend": Choice(("bm25", "dense")),
    "retrieval.corpus": Text("the corpus file of the index (SHA-256 checked at start)"),
    "retrieval.url": Text("http://host:port of a running retrieval service"),
    "retrieval.host": Text("auto, or an address the service binds"),
    "retrieval.port": PORT,
    "retrieval.max_batch_queries": POSITIVE,
    "retrieval.max_wait_ms": NON_NEGATIVE,
    "retrieval.startup_timeout_s": SECONDS,
}
"""Every int, float and str field of :class:`~megarl.config.schema.MegarlConfig` (Optional or not), by
dotted key. Booleans are typed by OmegaConf; lists and free dicts are not scalars."""

TOOL_DOMAINS: dict[str, dict[str, Domain]] = {
    "python": {"timeout_s": SECONDS, "cpu_s": POSITIVE, "memory_mb": POSITIVE, "max_processes": POSITIVE,
               "max_output_chars": POSITIVE, "tmpfs_mb": POSITIVE, "max_concurrency": POSITIVE},
    "search": {"url": Text("the retrieval service's URL (filled in by the launcher)"), "top_k": POSITIVE,
               "timeout_s": SECONDS, "max_passage_chars": POSITIVE, "retries": NON_NEGATIVE},
    "calculator": {},
}
"""Settings of the built-in tools (``rollout.tools.<registry name>``), as their constructors take them
(megarl/rollout/tools)."""

REWARD_DOMAINS: dict[str, dict[str, Domain]] = {
    "gsm8k": {"answer_key": Text("a field of the prompt rows"), "format_weight": NON_NEGATIVE,
              "executor": Choice(("process", "inline")), "num_workers": POSITIVE, "timeout_s": SECONDS},
    "judge": {"url": Text("the judge server's base URL"), "model": Text("the judge model's name"),
              "api": Choice(("chat", "completions")), "rubric": Text("a prompt holding {response}"),
              "question_key": Text("a field of the prompt rows"), "reference_key": Text("a field of the prompt rows"),
              "min_score": Range(), "max_score": Range(), "timeout_s": SECONDS, "retries": NON_NEGATIVE,
              "max_batch_size": POSITIVE, "max_wait_ms": NON_NEGATIVE, "max_concurrency": POSITIVE,
              "max_tokens": POSITIVE, "temperature": NON_NEGATIVE,
              "api_key_env": Text("an environment variable holding the API key")},
    "exact_match": {"answer_key": Text("a field of the prompt rows")},
    "answer_format": {},
    "tool_success_rate": {"no_calls_value": Range()},
    "turn_penalty": {"free_turns": NON_NEGATIVE},
    "overlong_penalty": {"max_tokens": POSITIVE, "buffer_tokens": POSITIVE},
    "composite": {},  # terms: a mapping of rewards, each built (and checked) by build_reward
}
"""Keyword arguments of the built-in rewards (``rollout.reward_kwargs`` when ``rollout.reward`` names
one), as their constructors take them (megarl/rollout/rewards)."""


def domain_issues(cfg: Any) -> list[tuple[str, str, Any]]:
    """Every value of ``cfg`` outside its declared domain.

    Args:
        cfg: a loaded config (:func:`megarl.config.loader.load_config`).

    Returns:
        ``(dotted key, message naming the domain, value)`` for each value outside its domain; None
        values are skipped (OmegaConf allows them only in Optional fields).
    """
    issues: list[tuple[str, str, Any]] = []

    def check(key: str, domain: Domain, value: Any) -> None:
        if value is not None and not domain.allows(value):
            issues.append((key, f"must be {domain}", value))

    for key, domain in DOMAINS.items():
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if node is not None else None
        check(key, domain, node)
    for name, settings in (cfg.rollout.tools or {}).items():
        for param, value in (settings or {}).items():
            if param in TOOL_DOMAINS.get(str(name), {}):
                check(f"rollout.tools.{name}.{param}", TOOL_DOMAINS[str(name)][param], value)
    for param, value in (cfg.rollout.reward_kwargs or {}).items():
        if param in REWARD_DOMAINS.get(str(cfg.rollout.reward), {}):
            check(f"rollout.reward_kwargs.{param}", REWARD_DOMAINS[str(cfg.rollout.reward)][param], value)
    return issues
