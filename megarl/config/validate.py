"""Cross-field validation: everything that can be checked before a process or a GPU is touched.

:func:`validate` collects every problem (each naming its key, value and what would be valid) and
raises one :class:`~megarl.config.loader.ConfigError`. It runs at the start of every command and as
``megarl validate CONFIG``. Architecture is read from the model's ``config.json`` (never retyped in
YAML) and checked against the parallel layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from megarl.config.loader import ConfigError, ConfigIssue
from megarl.config.builds import build_hint
from megarl.config.domains import DOMAINS, domain_issues

GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")
COLOCATED_MEMORY_LIMIT = 0.9
"""Colocated on CUDA: the most of a GPU's memory the engine's static pool and the trainer's share may
claim together (``rollout.engine.mem_fraction_static`` + ``cluster.colocated_trainer_memory_fraction``)."""
GSPO_MAX_CLIP = 0.05  # the paper's clip ranges are 3e-4 / 4e-4; PPO-sized ranges defeat GSPO


def _get(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def resolved_precision(cfg: DictConfig) -> str:
    """``train.precision`` with ``auto`` resolved: fp32 on CPU, bf16 on GPU."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    return "fp32" if _device_is_cpu(cfg) else "bf16"


def _parent(cfg: DictConfig, key: str) -> DictConfig:
    return _get(cfg, key.rsplit(".", 1)[0])


class _Checker:
    """Collects issues; ``check(cond, key, message)`` records one when ``cond`` is False."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.issues: list[ConfigIssue] = []

    def check(self, ok: bool, key: str, message: str, value: Any = "__from_cfg__") -> bool:
        if not ok:
            if value == "__from_cfg__":
                try:
                    value = _get(self.cfg, key)
                except Exception:  # noqa: BLE001 - a key missing in the cfg is reported as is
                    value = None
            self.issues.append(ConfigIssue(key, message, value))
        return ok


def _device_is_cpu(cfg: DictConfig) -> bool:
    if cfg.cluster.device == "cpu":
        return True
    if cfg.cluster.device == "cuda":
        return False
    try:
        import torch
        return not torch.cuda.is_available()
    except ImportError:
        return True


def _check_fields(c: _Checker) -> None:
    """Every field against its declared domain (:mod:`megarl.config.domains`), then the rules that
    relate a field to another."""
    for key, message, value in domain_issues(c.cfg):
        c.check(False, key, message, value=value)
    vpp = c.cfg.parallel.virtual_pipeline_model_parallel_size
    if vpp is not None:
        c.check(c.cfg.parallel.pipeline_model_parallel_size > 1, "parallel.virtual_pipeline_model_parallel_size",
                "interleaving needs pipeline_model_parallel_size > 1 (or null)")


def _trainer_world_size(cfg: DictConfig) -> int:
    return cfg.cluster.trainer_nodes * cfg.cluster.trainer_devices_per_node


def _check_parallel(c: _Checker) -> int:
    cfg, p = c.cfg, c.cfg.parallel
    world = _trainer_world_size(cfg)
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    mp = tp * pp * cp
    dp = world // mp if mp and world % mp == 0 else 0
    c.check(mp > 0 and world % mp == 0, "parallel.tensor_model_parallel_size",
            f"TP*PP*CP = {tp}*{pp}*{cp} = {mp} must divide the trainer world size "
            f"cluster.trainer_nodes*cluster.trainer_devices_per_node = {world}")
    c.check(world % (etp * ep * pp) == 0, "parallel.expert_model_parallel_size",
            f"ETP*EP*PP = {etp}*{ep}*{pp} must divide the trainer world size {world} "
            f"(expert_tensor_parallel_size defaults to TP={tp}; set it to 1 for TP>1 with EP>1 on few ranks)")
    c.check(not p.sequence_parallel or tp > 1, "parallel.sequence_parallel",
            "sequence parallelism needs tensor_model_parallel_size > 1")
    c.check(cp == 1 or not _device_is_cpu(cfg), "parallel.context_parallel_size",
            "context parallelism runs only through Transformer Engine attention on CUDA GPUs "
            "(Megatron-Core's local attention supports 1); set it to 1 on CPU")
    return dp


def _check_batches(c: _Checker, dp: int) -> None:
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
    if cfg.algorithm.advantage_estimator in GROUP_RELATIVE:
        c.check(g >= 2, "rollout.group_size",
                f"group-relative advantages ({cfg.algorithm.advantage_estimator}) need >= 2 trajectories per prompt")
    mtpm = cfg.train.max_tokens_per_microbatch
    ctx = cfg.rollout.agent.max_context_tokens
    if mtpm is not None:
        c.check(mtpm >= ctx, "train.max_tokens_per_microbatch",
                f"must be >= rollout.agent.max_context_tokens={ctx} so the longest trajectory fits")
    c.check(cfg.data.max_prompt_tokens < ctx, "data.max_prompt_tokens",
            f"must be < rollout.agent.max_context_tokens={ctx}")


def _check_algorithm(c: _Checker) -> None:
    """The algorithm's cross-field rules; each field's own range is in :data:`DOMAINS`."""
    a = c.cfg.algorithm
    if a.policy_loss in ("gspo", "gspo_token"):
        for key in ("clip_low", "clip_high"):
            value = a[key]
            c.check(not DOMAINS[f"algorithm.{key}"].allows(value) or value <= GSPO_MAX_CLIP, f"algorithm.{key}",
                    f"GSPO clips the sequence-level ratio: use a small positive range (paper: "
                    f"3e-4 low / 4e-4 high), at most {GSPO_MAX_CLIP}; PPO-sized ranges belong to ppo_clip")
    if a.clip_c is not None:
        c.check(a.policy_loss == "ppo_clip", "algorithm.clip_c",
                "dual clip needs policy_loss=ppo_clip (or clip_c=null)")
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


def _check_precision(c: _Checker) -> None:
    t = c.cfg.train
    if t.fp8 is not None:
        c.check(not _device_is_cpu(c.cfg), "train.fp8",
                "FP8 runs through Transformer Engine on CUDA GPUs only; set train.fp8=null on CPU")
        c.check(t.precision in ("bf16", "auto"), "train.precision", "FP8 training needs precision=bf16")
        _check_fp8_recipe(c)
    if _device_is_cpu(c.cfg):
        c.check(t.precision in ("fp32", "auto"), "train.precision",
                "CPU training runs in fp32 (Megatron-Core's CPU path); set train.precision=fp32")


def _check_fp8_recipe(c: _Checker) -> None:
    """FP8 recipe vs the algorithm and, where a GPU is visible, vs the device, torch and TE."""
    from megarl.training.fp8 import HISTORY_FREE_RECIPES, fp8_support_error_here

    recipe = c.cfg.train.fp8_recipe
    if c.cfg.algorithm.policy_loss in ("gspo", "gspo_token"):
        c.check(recipe in HISTORY_FREE_RECIPES or not DOMAINS["train.fp8_recipe"].allows(recipe), "train.fp8_recipe",
                "delayed scaling quantises the old-logprob pass and the training forward with different "
                "(history) scales, so GSPO's first sequence ratio is not 1 and its 3e-4 clip fires on FP8 "
                f"noise; use one of {', '.join(HISTORY_FREE_RECIPES)}")
    if DOMAINS["train.fp8_recipe"].allows(recipe) and not _device_is_cpu(c.cfg):
        error = fp8_support_error_here(recipe)  # None where no GPU is visible: checked again at build
        c.check(error is None, "train.fp8_recipe", str(error))


def _check_cluster(c: _Checker) -> None:
    cfg = c.cfg
    cl, r = cfg.cluster, cfg.rollout
    if r.external_engine_urls:
        return
    engine_devices = r.num_engines * r.engine.tensor_parallel_size
    if cl.placement == "disaggregated":
        available = cl.rollout_nodes * cl.rollout_devices_per_node
        c.check(engine_devices <= available, "rollout.num_engines",
                f"num_engines*engine.tensor_parallel_size = {engine_devices} devices, but the rollout "
                f"side has cluster.rollout_nodes*cluster.rollout_devices_per_node = {available}")
    else:
        world = _trainer_world_size(cfg)
        c.check(engine_devices <= world, "rollout.num_engines",
                f"colocated engines need {engine_devices} devices; the trainer has {world}")
    if cfg.weight_sync.transport == "tensor":
        c.check(cl.placement == "colocated", "weight_sync.transport",
                "the tensor transport shares memory: it needs cluster.placement=colocated")
    if cl.placement == "colocated" and cfg.weight_sync.transport in ("distributed", "p2p"):
        from megarl.cluster.placement import use_cuda

        nccl = cfg.weight_sync.backend == "nccl" or (cfg.weight_sync.backend == "auto" and use_cuda(cl.device))
        c.check(not nccl, "weight_sync.transport",
                f"the {cfg.weight_sync.transport} transport connects trainer and engine ranks over NCCL, which "
                "cannot connect a trainer rank to the engine rank on its own GPU (NCCL refuses two ranks on "
                "one device); colocated runs use weight_sync.transport=tensor (CUDA IPC)")
    if cl.placement == "colocated":
        from megarl.cluster.placement import use_cuda

        engine, trainer = r.engine.mem_fraction_static, cl.colocated_trainer_memory_fraction
        c.check(not use_cuda(cl.device) or engine + trainer <= COLOCATED_MEMORY_LIMIT,
                "rollout.engine.mem_fraction_static",
                f"colocated engines keep rollout.engine.mem_fraction_static={engine} of each GPU while the trainer "
                f"keeps cluster.colocated_trainer_memory_fraction={trainer}: {engine + trainer:.2f} together, over "
                f"{COLOCATED_MEMORY_LIMIT} (the rest holds CUDA contexts, NCCL buffers and the engines' "
                "activations); lower one of them")
    if cl.placement == "colocated" and cfg.rollout.async_mode:
        from megarl.cluster.placement import use_cuda

        c.check(not use_cuda(cl.device), "rollout.async_mode",
                "colocated engines share their GPUs with the trainer: they lend it their memory only while "
                "they are idle, so generation cannot run during training; use cluster.placement=disaggregated "
                "for async RL")
    alloc_nodes = os.environ.get("MEGARL_ALLOC_NODES")
    if alloc_nodes:
        need = cl.trainer_nodes + (cl.rollout_nodes if cl.placement == "disaggregated" else 0)
        c.check(need <= int(alloc_nodes), "cluster.trainer_nodes",
                f"the run needs {need} nodes (trainer_nodes + rollout_nodes) but the allocation has "
                f"{alloc_nodes} (MEGARL_ALLOC_NODES)")
    alloc_gpus = os.environ.get("MEGARL_ALLOC_GPUS_PER_NODE")
    if alloc_gpus:
        for key in ("cluster.trainer_devices_per_node", "cluster.rollout_devices_per_node"):
            c.check(_get(cfg, key) <= int(alloc_gpus), key,
                    f"more devices per node than the allocation's {alloc_gpus} (MEGARL_ALLOC_GPUS_PER_NODE)")


def _family_error(hf_config) -> str | None:
    """Why the model family registry (megarl.models.families) cannot handle this config, or None."""
    from megarl.models.families import get_family

    try:
        get_family(hf_config)
    except ValueError as e:
        return str(e)
    return None


def read_hf_config(hf_path: str):
    """Read ``{hf_path}/config.json`` through ``transformers.AutoConfig`` (both 4.x and 5 spellings).

    Raises:
        OSError / ValueError: unreadable or unknown config.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_path, trust_remote_code=False, local_files_only=True)


def num_experts_of(hf_config) -> int:
    """Routed experts per MoE layer (0 for dense models), whichever spelling the config uses."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


SGLANG_UNTIED_LM_HEAD = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
"""Families whose SGLang 0.5.23 model class builds ``lm_head`` as its own parameter whatever
``tie_word_embeddings`` says (``srt/models/qwen3_moe.py``, ``glm4_moe.py`` never read it; ``qwen3.py``
and ``deepseek_v2.py`` do): a tied checkpoint has no ``lm_head.weight``, so the engine would sample
from an lm_head that nothing ever loads."""


def _check_model(c: _Checker) -> None:
    cfg = c.cfg
    hf_path = cfg.model.hf_path
    if not c.check(Path(hf_path).is_dir() and (Path(hf_path) / "config.json").is_file(), "model.hf_path",
                   "must be a Hugging Face model directory containing config.json (or a hub id "
                   "org/name[@revision], which the megarl commands resolve first: megarl.config.hub)"
                   + build_hint(hf_path)):
        return
    try:
        hf = read_hf_config(hf_path)
    except Exception as e:  # noqa: BLE001 - any failure to parse is reported with the key
        c.check(False, "model.hf_path", f"config.json could not be read: {e}")
        return
    family_error = _family_error(hf)
    c.check(family_error is None, "model.hf_path", f"config.json: {family_error}")
    model_type = getattr(hf, "model_type", None)
    c.check(not (getattr(hf, "tie_word_embeddings", False) and model_type in SGLANG_UNTIED_LM_HEAD), "model.hf_path",
            f"config.json: tie_word_embeddings=true, but SGLang's {SGLANG_UNTIED_LM_HEAD.get(model_type)} keeps its "
            "lm_head separate from embed_tokens and never loads it from a tied checkpoint (the engines would "
            "sample from an untrained output layer); untie the checkpoint (lm_head.weight = "
            "embed_tokens.weight, tie_word_embeddings=false)")
    from megarl.rollout.reasoning import parser_issues

    agent = cfg.rollout.agent
    for key, message in parser_issues(getattr(hf, "model_type", None), agent.reasoning_parser, agent.tool_call_parser):
        c.check(False, key, message)
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    heads, groups = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    c.check(heads % tp == 0, "parallel.tensor_model_parallel_size",
            f"num_attention_heads={heads} (config.json) must be divisible by TP")
    c.check(groups % tp == 0, "parallel.tensor_model_parallel_size",
            f"num_key_value_heads (query groups)={groups} (config.json) must be divisible by TP")
    chunks = pp * (p.virtual_pipeline_model_parallel_size or 1)
    first, last = p.get("num_layers_in_first_pipeline_stage"), p.get("num_layers_in_last_pipeline_stage")
    if first is None and last is None:
        c.check(hf.num_hidden_layers % chunks == 0, "parallel.pipeline_model_parallel_size",
                f"num_hidden_layers={hf.num_hidden_layers} (config.json) must be divisible by "
                f"PP*VPP = {chunks} (or set parallel.num_layers_in_first/last_pipeline_stage)")
    else:
        c.check(_uneven_stage_error(p, hf.num_hidden_layers) is None, "parallel.num_layers_in_first_pipeline_stage",
                str(_uneven_stage_error(p, hf.num_hidden_layers)))
    experts = num_experts_of(hf)
    ep = p.expert_model_parallel_size
    if experts:
        c.check(experts % ep == 0, "parallel.expert_model_parallel_size",
                f"num_moe_experts={experts} (config.json) must be divisible by EP")
        c.check(tp == 1 or p.sequence_parallel, "parallel.sequence_parallel",
                "Megatron requires sequence_parallel=true for MoE models with tensor_model_parallel_size > 1")
        _check_moe_fp8(c)
    else:
        c.check(ep == 1, "parallel.expert_model_parallel_size", "the model has no experts: use 1")
        c.check(cfg.train.routing_replay == "none", "train.routing_replay",
                "routing replay needs an MoE model")
    engine_ep = cfg.rollout.engine.expert_parallel_size
    if experts:
        c.check(engine_ep < 1 or experts % engine_ep == 0, "rollout.engine.expert_parallel_size",
                f"num_moe_experts={experts} (config.json) must be divisible by the engine EP")
    else:
        c.check(engine_ep == 1, "rollout.engine.expert_parallel_size", "the model has no experts: use 1")
    etp = cfg.rollout.engine.tensor_parallel_size
    c.check(heads % etp == 0, "rollout.engine.tensor_parallel_size",
            f"num_attention_heads={heads} (config.json) must be divisible by the engine TP")


def _check_moe_fp8(c: _Checker) -> None:
    """FP8 on an MoE model pads each expert's routing map (megarl.training.fp8: moe_router_padding_for_fp8),
    which Megatron-Core 0.16.1 refuses with the allgather dispatcher (TransformerConfig.__post_init__)."""
    fp8 = c.cfg.train.fp8
    c.check(fp8 is None or c.cfg.model.moe_token_dispatcher_type != "allgather", "model.moe_token_dispatcher_type",
            f"train.fp8={fp8} pads the routing map per expert (moe_router_padding_for_fp8), which Megatron-Core "
            "refuses with the allgather dispatcher: set model.moe_token_dispatcher_type=alltoall or train.fp8=null")


def _uneven_stage_error(p: DictConfig, num_layers: int) -> str | None:
    """Why ``parallel.num_layers_in_first/last_pipeline_stage`` cannot split ``num_layers``, or None.

    The layer assignment is the weight-sync layout's (``TrainerLayout``), which is tested against
    Megatron's ``get_transformer_layer_offset`` / ``get_num_layers_to_build``.
    """
    from megarl.weight_sync.layout import LayoutError, TrainerLayout

    first, last = p.get("num_layers_in_first_pipeline_stage"), p.get("num_layers_in_last_pipeline_stage")
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            return f"num_layers_in_{name}_pipeline_stage must be >= 1"
    middle_stages = p.pipeline_model_parallel_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages > 0) != (middle_layers > 0):  # Megatron's own rule
        return (f"first/last stage layers ({first}, {last}) leave {middle_layers} of num_hidden_layers="
                f"{num_layers} (config.json) for {max(middle_stages, 0)} middle pipeline stages")
    try:
        TrainerLayout(pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                      virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
                      num_layers_in_first_pipeline_stage=first,
                      num_layers_in_last_pipeline_stage=last).layer_location(0, num_layers)
    except LayoutError as err:
        return f"{err} (num_hidden_layers={num_layers} from config.json)"
    return None


def _check_load_dir(c: _Checker) -> None:
    """``model.load_dir`` holds ``model.hf_path``'s model (:func:`megarl.checkpoint.load_dir.check_load_dir`)."""
    load_dir = c.cfg.model.get("load_dir")
    if not load_dir:
        return
    from megarl.checkpoint.load_dir import check_load_dir

    try:
        check_load_dir(load_dir, c.cfg.model.hf_path)
    except (OSError, ValueError) as e:  # not a checkpoint, another model's, unreadable metadata
        c.check(False, "model.load_dir", str(e))


def _check_paths(c: _Checker) -> None:
    d = c.cfg.data
    if d.get("dataset", "file") != "file":  # a plugin's reader decides what its paths mean
        return
    for key in ("data.train_path", "data.eval_path"):
        path = _get(c.cfg, key)
        if path is not None:
            c.check(Path(path).is_file(), key, "file not found (jsonl or parquet)" + build_hint(path))
    tokenizer = c.cfg.model.tokenizer_path
    if tokenizer is not None:
        c.check(Path(tokenizer).is_dir(), "model.tokenizer_path", "directory not found" + build_hint(tokenizer))


def _check_plugins(c: _Checker) -> None:
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
             lambda cfg: cfg.rollout.engine.tensor_parallel_size % max(cfg.rollout.engine.expert_parallel_size, 1) != 0),
    Conflict("model.moe_grouped_gemm",
             "grouped GEMM runs through Transformer Engine on CUDA; set it to null (auto) or false on CPU",
             lambda cfg: cfg.model.moe_grouped_gemm is True and _device_is_cpu(cfg)),
]
"""Cross-feature conflicts checked before anything starts, one row each. Conflicts that need the
model's config.json (engine EP vs the number of experts) are in ``_check_model``; FP8 recipe vs
device in ``_check_fp8_recipe``; colocated placement vs transport in ``_check_cluster``."""


def _check_conflicts(c: _Checker) -> None:
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


def _check_megatron_overrides(c: _Checker) -> None:
    """``model.megatron_overrides``: Megatron's own dataclass fields only, none that megarl owns."""
    overrides = c.cfg.model.get("megatron_overrides") or {}
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


def _check_engine_packing(c: _Checker) -> None:
    """Each engine fits on one node (or spans whole nodes: :func:`_check_engine_nodes`), and the
    engines pack onto the nodes whole."""
    cfg = c.cfg
    cl, r = cfg.cluster, cfg.rollout
    if r.external_engine_urls:
        return
    tp = r.engine.tensor_parallel_size
    if cl.placement == "disaggregated":
        nodes, per_node, where = cl.rollout_nodes, cl.rollout_devices_per_node, "cluster.rollout_devices_per_node"
    else:
        nodes, per_node, where = cl.trainer_nodes, cl.trainer_devices_per_node, "cluster.trainer_devices_per_node"
    if tp < 1 or per_node < 1:
        return  # reported by the field checks
    if tp > per_node:
        _check_engine_nodes(c, tp, nodes, per_node, where)
        return
    per_node_engines = per_node // tp
    c.check(r.num_engines <= nodes * per_node_engines, "rollout.num_engines",
            f"{per_node_engines} engine(s) of TP {tp} fit on each of the {nodes} node(s) ({where}={per_node}, "
            f"engines never straddle nodes): at most {nodes * per_node_engines} engines")


def _check_engine_nodes(c: _Checker, tp: int, nodes: int, per_node: int, where: str) -> None:
    """An engine larger than a node spans whole, consecutive nodes (SGLang's ``--nnodes``): only
    disaggregated, its devices a multiple of the node's, and the engines' nodes within the rollout's."""
    cfg = c.cfg
    if not c.check(cfg.cluster.placement == "disaggregated", "rollout.engine.tensor_parallel_size",
                   f"a colocated engine runs on one node: its {tp} devices exceed {where}={per_node} "
                   "(engines span nodes only with cluster.placement=disaggregated)"):
        return
    if not c.check(tp % per_node == 0, "rollout.engine.tensor_parallel_size",
                   f"an engine of {tp} devices would span a partial node ({where}={per_node}): an engine larger "
                   f"than a node spans whole nodes, so make it a multiple of {per_node}"):
        return
    span = tp // per_node
    c.check(cfg.rollout.num_engines * span <= nodes, "rollout.num_engines",
            f"each engine of TP {tp} spans {span} whole nodes ({where}={per_node}): {cfg.rollout.num_engines} "
            f"engines need {cfg.rollout.num_engines * span} nodes, cluster.rollout_nodes={nodes}")


def _check_fit(c: _Checker) -> None:
    """Trainer and engine ranks fit the GPU's memory (`megarl.plan.fit`), when the GPU is known."""
    from megarl.plan.fit import fit_problems, known_gpu

    cfg = c.cfg
    try:
        gpu = known_gpu(cfg)
    except ValueError as e:
        c.check(False, "cluster.gpu", str(e))
        return
    if gpu is None:
        return  # a CPU run, or no GPU named and none here: nothing to size against
    for key, message in fit_problems(cfg, read_hf_config(cfg.model.hf_path), gpu, precision=resolved_precision(cfg)):
        c.check(False, key, message)


def _cross_field(c: _Checker, out_of_domain: bool, rule: Callable[..., Any], *args: Any) -> Any:
    """Run a rule relating several fields. With a field outside its domain (already reported) a rule
    may not compute (``expert_model_parallel_size=0`` divides by zero): it is skipped, not raised."""
    try:
        return rule(c, *args)
    except (ArithmeticError, TypeError, ValueError):
        if not out_of_domain:
            raise
        return None


def validate(cfg: DictConfig, *, check_paths: bool = True, check_fit: bool = True) -> DictConfig:
    """Check a loaded config across fields, the model's config.json, the cluster and the registries.

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
    c = _Checker(cfg)
    missing = [k for k in ("model.hf_path", "data.train_path") if OmegaConf.is_missing(_parent(cfg, k), k.split(".")[-1])]
    for key in missing:
        c.check(False, key, "required: set it in the YAML or as an override", value="???")
    if missing:
        raise ConfigError(c.issues)
    _check_fields(c)
    out_of_domain = bool(c.issues)
    dp = _cross_field(c, out_of_domain, _check_parallel) or 0
    for rule in (_check_algorithm, _check_precision, _check_cluster, _check_plugins, _check_conflicts,
                 _check_engine_packing, _check_megatron_overrides):
        _cross_field(c, out_of_domain, rule)
    _cross_field(c, out_of_domain, _check_batches, dp)
    if check_paths:
        _cross_field(c, out_of_domain, _check_model)
        _check_paths(c)
        if not any(issue.key == "model.hf_path" for issue in c.issues):
            _check_load_dir(c)
        if check_fit and not c.issues:
            _check_fit(c)
    if c.issues:
        raise ConfigError(c.issues)
    return cfg
