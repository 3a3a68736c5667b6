"""Cross-field validation: every rule that needs only the config (and the model's ``config.json``),
checked before a process or a GPU is touched.

:func:`validate` collects every problem (each naming its key, value and what would be valid) and
raises one :class:`~megarl.config.loader.ConfigError`. Architecture is read from the model's
``config.json`` (never retyped in YAML) and checked against the parallel layout
(:mod:`megarl.config.model_rules`, :mod:`megarl.config.parallel`); the cluster's rules are in
:mod:`megarl.config.cluster_rules`. Rules that need a layer's own knowledge (FP8 support, the
weight-sync layout, a checkpoint's contents) are that layer's functions: the launch layer's
preflight (:func:`megarl.launch.preflight.preflight`) gathers them with these, at the start of
every command and as ``megarl validate CONFIG``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megarl.config.builds import build_hint
from megarl.config.checker import Checker, get_key
from megarl.config.cluster_rules import check_cluster, check_engine_packing
from megarl.config.device import resolved_precision, use_cuda
from megarl.config.domains import domain_issues
from megarl.config.loader import ConfigError, ConfigIssue
from megarl.config.model_rules import check_model, read_hf_config
from megarl.config.parallel import parallel_size_issues, trainer_world_size


def _parent(cfg: DictConfig, key: str) -> DictConfig:
    return get_key(cfg, key.rsplit(".", 1)[0])


def _check_fields(c: Checker) -> None:
    """Every field against its declared domain (:mod:`megarl.config.domains`). ``plugins`` are
    imported first: the names they register are choices of the fields that select an extension (a
    plugin that fails to import is reported by :func:`_check_plugins`)."""
    from megarl.plugins import PluginError, import_plugins

    try:
        import_plugins(c.cfg.plugins)
    except PluginError:
        pass
    for key, message, value in domain_issues(c.cfg):
        c.check(False, key, message, value=value)


def _check_parallel(c: Checker) -> int:
    """The parallel sizes against the trainer world size (:mod:`megarl.config.parallel`) and the device.

    Returns:
        The data-parallel size (0 when TP*PP*CP does not divide the world).
    """
    cfg, p = c.cfg, c.cfg.parallel
    world = trainer_world_size(cfg.cluster)
    for key, message in parallel_size_issues(
            p, world, f"cluster.trainer_nodes*cluster.trainer_devices_per_node = {world}"):
        c.check(False, key, message)
    c.check(p.context_parallel_size == 1 or use_cuda(cfg.cluster.device), "parallel.context_parallel_size",
            "context parallelism runs only through Transformer Engine attention on CUDA GPUs "
            "(Megatron-Core's local attention supports 1); set it to 1 on CPU")
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    return world // mp if mp and world % mp == 0 else 0


def _check_batches(c: Checker, dp: int) -> None:
    cfg = c.cfg
    gbs, mbs, g = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.rollout.group_size
    num_traj = cfg.rollout.num_prompts_per_step * g
    if dp:
        c.check(gbs % dp == 0, "train.global_batch_size",
                f"must be divisible by the data-parallel size {dp}")
        if cfg.train.max_tokens_per_microbatch is None:
            c.check(gbs % (mbs * dp) == 0, "train.global_batch_size",
                    f"must be divisible by micro_batch_size*DP = {mbs}*{dp} when max_tokens_per_microbatch is null")
    c.check(num_traj % gbs == 0, "train.global_batch_size",
            f"must divide the trajectories per step rollout.num_prompts_per_step*rollout.group_size = {num_traj}")
    c.check(gbs % g == 0, "train.global_batch_size",
            f"must be a multiple of rollout.group_size={g} so optimizer steps hold whole groups")
    mtpm = cfg.train.max_tokens_per_microbatch
    ctx = cfg.rollout.agent.max_context_tokens
    if mtpm is not None:
        c.check(mtpm >= ctx, "train.max_tokens_per_microbatch",
                f"must be >= rollout.agent.max_context_tokens={ctx} so the longest trajectory fits")
    c.check(cfg.data.max_prompt_tokens < ctx, "data.max_prompt_tokens",
            f"must be < rollout.agent.max_context_tokens={ctx}")


def _check_algorithm(c: Checker) -> None:
    """The algorithm's cross-field rules: the policy loss, advantage estimator and rollout correction
    against their registry entries (:mod:`megarl.config.algorithm_rules`), then staleness; each
    field's own range is in :data:`megarl.config.domains.DOMAINS`."""
    from megarl.config.algorithm_rules import algorithm_issues

    for key, message, value in algorithm_issues(c.cfg):
        c.check(False, key, message, value=value)
    ro, every = c.cfg.rollout, c.cfg.weight_sync.every_n_steps
    if ro.async_mode:
        c.check(ro.max_staleness >= 1, "rollout.max_staleness", "async mode needs >= 1")
        c.check(every < 1 or ro.max_staleness >= every, "rollout.max_staleness",
                f"async mode with weight_sync.every_n_steps={every} needs max_staleness >= {every} "
                f"(the engines lag up to {every - 1} versions; one more step must fit in flight)")
    else:
        c.check(every < 1 or ro.max_staleness >= every - 1, "rollout.max_staleness",
                f"weight_sync.every_n_steps={every} trains rollouts up to {every - 1} versions old: "
                f"set max_staleness >= {every - 1}")


def _check_precision(c: Checker) -> None:
    t = c.cfg.train
    if t.fp8 is not None:
        c.check(use_cuda(c.cfg.cluster.device), "train.fp8",
                "FP8 runs through Transformer Engine on CUDA GPUs only; set train.fp8=null on CPU")
        c.check(t.precision in ("bf16", "auto"), "train.precision", "FP8 training needs precision=bf16")
    if not use_cuda(c.cfg.cluster.device):
        c.check(t.precision in ("fp32", "auto"), "train.precision",
                "CPU training runs in fp32 (Megatron-Core's CPU path); set train.precision=fp32")


def _check_paths(c: Checker) -> None:
    d = c.cfg.data
    if d.dataset != "file":  # a plugin's reader decides what its paths mean
        return
    for key in ("data.train_path", "data.eval_path"):
        path = get_key(c.cfg, key)
        if path is not None:
            c.check(Path(path).is_file(), key, "file not found (jsonl or parquet)" + build_hint(path))
    tokenizer = c.cfg.model.tokenizer_path
    if tokenizer is not None:
        c.check(Path(tokenizer).is_dir(), "model.tokenizer_path", "directory not found" + build_hint(tokenizer))


def _check_plugins(c: Checker) -> None:
    """``plugins`` import; tools, reward, agent loop and dataset resolve through their registries or
    import paths and fit their protocols (:mod:`megarl.config.plugin_check`)."""
    from megarl.config.plugin_check import plugin_issues

    for key, message, value in plugin_issues(c.cfg):
        c.check(False, key, message, value=value)


@dataclass(frozen=True)
class Conflict:
    """Two features that cannot run together: ``applies(cfg)`` is True when ``cfg`` combines them."""

    key: str
    """The key the error names (the one to change)."""
    message: str
    applies: Callable[[DictConfig], bool]


CONFLICTS: list[Conflict] = [
    Conflict("rollout.engine.expert_parallel_size",
             "SGLang splits each engine's experts over EP and the rest of its TP (moe_tp = tp / ep): "
             "rollout.engine.expert_parallel_size must divide rollout.engine.tensor_parallel_size",
             lambda cfg: cfg.rollout.engine.tensor_parallel_size
             % max(cfg.rollout.engine.expert_parallel_size, 1) != 0),
    Conflict("weight_sync.pause_mode",
             "train.routing_replay=r3 with rollout.async_mode=true needs weight_sync.pause_mode=abort: a weight "
             "sync pauses requests in flight, and R3 must replay the routes they were sampled with; 'retract' "
             "re-prefills them under the new weights and SGLang then reports the re-prefill's routes for the "
             "tokens sampled before the pause (no way to get the earlier ones), and 'in_place' keeps them "
             "running on old-policy KV that the sync's cache flush cannot clear (the sync fails)",
             lambda cfg: (cfg.train.routing_replay == "r3" and bool(cfg.rollout.async_mode)
                          and cfg.weight_sync.pause_mode != "abort")),
    Conflict("model.moe_grouped_gemm",
             "grouped GEMM runs through Transformer Engine on CUDA; set it to null (auto) or false on CPU",
             lambda cfg: cfg.model.moe_grouped_gemm is True and not use_cuda(cfg.cluster.device)),
]
"""Cross-feature conflicts checked before anything starts, one row each. Conflicts that need the
model's config.json (engine EP vs the number of experts) are in :mod:`megarl.config.model_rules`;
FP8 recipe vs device in :func:`megarl.training.fp8.fp8_recipe_issues`; colocated placement vs
transport in :mod:`megarl.config.cluster_rules`.

R3 vs pause mode (issue 28): only a sync with requests in flight (async mode) can interrupt a
generation; R3 then keeps, per position, the route of the forward that read it first (the one that
sampled the next token; ``megarl.rollout.agent._stitch_routes``). SGLang 0.5.23, per mode:
``abort`` finishes a running request after one more forward and returns its routes
(``Scheduler.abort_request`` sets ``to_finish``; ``BatchResultProcessor._maybe_collect_routed_experts``):
kept. ``retract`` frees the request's KV slots (``schedule_batch.release_req``), and the routes are
captured per KV slot (``state_capturer/base.py``: ``TopkCaptureOutput.finalize`` writes
``host_cache.buffer[out_cache_loc]``, ``BaseTopkCapturer.get_topk`` reads them through
``req_to_token`` when the request finishes), so the finished request reports the re-prefill's routes
under the new weights for every position, and a retracted request returns nothing before it
finishes: refused. ``in_place`` would keep the routes (no re-prefill) but leaves the requests
running, so ``Scheduler.flush_cache`` (``is_fully_idle``) refuses the sync's flush: refused. Without
async mode nothing is in flight during a sync (the manager aborts its over-sampled requests itself,
with ``abort``, whatever ``weight_sync.pause_mode`` is), so every mode is accepted."""


def _check_conflicts(c: Checker) -> None:
    for conflict in CONFLICTS:
        try:
            bad = conflict.applies(c.cfg)
        except Exception:  # noqa: BLE001 - a malformed value is reported by its own field check
            continue
        c.check(not bad, conflict.key, conflict.message)


MEGARL_OWNED_MEGATRON_FIELDS = {
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "parallel.virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size", "sequence_parallel": "parallel.sequence_parallel",
    "use_distributed_optimizer": "parallel.use_distributed_optimizer",
    "num_layers_in_first_pipeline_stage": "parallel.num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage": "parallel.num_layers_in_last_pipeline_stage",
    "params_dtype": "train.precision", "bf16": "train.precision", "fp16": "train.precision",
    "fp8": "train.fp8", "fp8_recipe": "train.fp8_recipe", "moe_grouped_gemm": "model.moe_grouped_gemm",
    "recompute_granularity": "model.recompute_granularity",
    "num_layers": "config.json", "hidden_size": "config.json", "num_attention_heads": "config.json",
    "num_query_groups": "config.json", "ffn_hidden_size": "config.json", "kv_channels": "config.json",
    "num_moe_experts": "config.json", "moe_ffn_hidden_size": "config.json", "moe_router_topk": "config.json",
}
"""Megatron fields megarl derives from its own sections (or the model's config.json): an override
would desynchronise the parallel state, the weight-sync plan or the checkpoint mapping."""


def _check_megatron_overrides(c: Checker) -> None:
    """``model.megatron_overrides``: Megatron's own dataclass fields only, none that megarl owns."""
    overrides = c.cfg.model.megatron_overrides or {}
    if not overrides:
        return
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    known = {f.name for cls in (MLATransformerConfig, DistributedDataParallelConfig) for f in dataclasses.fields(cls)}
    for name in overrides:
        key = f"model.megatron_overrides.{name}"
        if not c.check(name in known, key, "not a field of Megatron-Core's TransformerConfig or "
                       "DistributedDataParallelConfig (megatron/core/transformer/transformer_config.py, "
                       "megatron/core/distributed/distributed_data_parallel_config.py)"):
            continue
        owner = MEGARL_OWNED_MEGATRON_FIELDS.get(name)
        c.check(owner is None, key, f"megarl sets this from {owner}; set it there")


def fit_issues(cfg: DictConfig) -> list[ConfigIssue]:
    """Trainer and engine ranks against the GPU's memory (`megarl.plan.fit`), when the GPU is known.

    Run it on an otherwise valid config (it reads ``config.json`` and computes with every size).
    """
    from megarl.plan.fit import fit_problems, known_gpu

    c = Checker(cfg)
    try:
        gpu = known_gpu(cfg)
    except ValueError as e:
        c.check(False, "cluster.gpu", str(e))
        return c.issues
    if gpu is None:
        return c.issues  # a CPU run, or no GPU named and none here: nothing to size against
    for key, message in fit_problems(cfg, read_hf_config(cfg.model.hf_path), gpu, precision=resolved_precision(cfg)):
        c.check(False, key, message)
    return c.issues


def _cross_field(c: Checker, out_of_domain: bool, rule: Callable[..., Any], *args: Any) -> Any:
    """Run a rule relating several fields. With a field outside its domain (already reported) a rule
    may not compute (``expert_model_parallel_size=0`` divides by zero): it is skipped, not raised."""
    try:
        return rule(c, *args)
    except (ArithmeticError, TypeError, ValueError):
        if not out_of_domain:
            raise
        return None


def config_issues(cfg: DictConfig, *, check_paths: bool = True) -> list[ConfigIssue]:
    """Every problem the rules that need only the config (and the model's config.json) find.

    The fit check (:func:`fit_issues`) is not among them: it runs on a config without problems.

    Args:
        cfg: from :func:`megarl.config.loader.load_config`.
        check_paths: also check that model, data and tokenizer paths exist and read config.json.

    Returns:
        The problems, each naming its key; empty when there are none.

    Raises:
        ConfigError: a required key (``model.hf_path``, ``data.train_path``) is missing; nothing else
            can be checked without it.
    """
    c = Checker(cfg)
    missing = [k for k in ("model.hf_path", "data.train_path")
               if OmegaConf.is_missing(_parent(cfg, k), k.split(".")[-1])]
    for key in missing:
        c.check(False, key, "required: set it in the YAML or as an override", value="???")
    if missing:
        raise ConfigError(c.issues)
    _check_fields(c)
    out_of_domain = bool(c.issues)
    dp = _cross_field(c, out_of_domain, _check_parallel) or 0
    for rule in (_check_algorithm, _check_precision, check_cluster, _check_plugins, _check_conflicts,
                 check_engine_packing, _check_megatron_overrides):
        _cross_field(c, out_of_domain, rule)
    _cross_field(c, out_of_domain, _check_batches, dp)
    if check_paths:
        _cross_field(c, out_of_domain, check_model)
        _check_paths(c)
    return c.issues


def validate(cfg: DictConfig, *, check_paths: bool = True, check_fit: bool = True) -> DictConfig:
    """Check a loaded config across fields, the model's config.json, the cluster and the registries:
    the rules that need only the config. ``megarl validate`` adds every layer's own rules
    (:func:`megarl.launch.preflight.preflight`).

    Args:
        cfg: from :func:`megarl.config.loader.load_config`.
        check_paths: also check that model, data and tokenizer paths exist and read config.json.
        check_fit: with ``check_paths`` and no other problem, also check that the trainer and engine
            ranks fit the GPU's memory (`megarl.plan.fit`; only when ``cluster.gpu`` is set or
            ``cluster.device`` is cuda; ``megarl plan`` turns it off to show the numbers instead).

    Returns:
        ``cfg``, unchanged, when valid.

    Raises:
        ConfigError: listing every problem found.
    """
    issues = config_issues(cfg, check_paths=check_paths)
    if check_paths and check_fit and not issues:
        issues = fit_issues(cfg)
    if issues:
        raise ConfigError(issues)
    return cfg
