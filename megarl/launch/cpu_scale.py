"""`cpu_scale`: the one mechanism that shrinks any recipe to a first RL step on one CPU host.

``megarl train --cpu-scale RECIPE`` (and ``megarl validate --cpu-scale``) run a recipe written for a
GPU cluster on this machine, keeping every feature it turns on, so CI can check that each recipe in
``configs/`` and ``examples/`` starts and completes its first step. What changes, and why:

| section | becomes | why |
|---|---|---|
| ``model.hf_path`` | ``tiny:<family>`` of the recipe model's ``model_type`` (or the recipe's own ``tiny:``), with one MTP layer where the recipe model has them, block FP8 (:data:`TWIN_FP8_BLOCK`) where it is | same architecture family, seconds to build |
| ``model.tokenizer_path`` | the tiny model's | it belongs to the replaced model |
| ``model.load_dir`` | none | a checkpoint of the replaced model |
| ``model.moe_grouped_gemm`` | off | grouped GEMM kernels are CUDA-only |
| ``train.fp8`` | off (and ``train.fp8_recipe`` back to its default) | Transformer Engine FP8 needs a GPU |
| ``train.precision`` | ``fp32`` | CPU compute |
| ``parallel`` | world size 2: TP 2 (with SP) if the recipe uses TP, else PP 2 if it uses PP, else DP 2; EP ``min(EP, 2)``, ETP 1 with EP; CP 1 | two CPU ranks |
| ``cluster`` | CPU, one node, 2 trainer devices, as many rollout devices as the engine's TP, no ``cluster.gpu``; placement kept | one host (the planner's GPU does not apply) |
| ``rollout`` | 1 engine of TP 2 where the recipe's engines have TP > 1 and the family is in ``ENGINE_TP2_FAMILIES`` (else TP 1), engine EP 1, fp32, small KV cache; 2 prompts x group 2; at most 2 turns of 32 tokens; prompt 512 and context 1024 tokens (the tiny template renders the tools' JSON schemas) | two cores |
| ``train`` | 1 RL step, one optimizer step, no LR warm-up | the first step |
| ``sft``, ``data`` | at most 1 SFT step; no evaluation rollouts | the same code paths, short |
| ``algorithm.filter_zero_variance_groups`` | off | a random tiny model's rewards rarely vary; the step must still train |
| ``checkpoint`` | no periodic saves or HF exports | the run has one step |

Kept as the recipe says: routing replay (R2/R3), activation recomputation, the algorithm and its
rollout correction, async mode and staleness, partial rollouts, deterministic sampling, the
weight-sync transport and its verification, placement (disaggregated / colocated), tools, reward,
agent loop and plugins. Every change that switches a recipe's feature off (or drops a parallel
dimension) is reported in a line starting ``cpu-scale:``; :func:`cpu_scale` returns the lines and
the CLI prints them. So is every structural feature of the recipe that shapes the weight sync and the
loaders (:mod:`megarl.launch.twin_features`) that the twin does not keep: MTP layers beyond one (or of a
family without a tiny MTP layer), the number of expert-data-parallel copies, engine TP > 1 of a family not in
:data:`ENGINE_TP2_FAMILIES`. Kept by construction: several buckets per stage, cut inside layers
(``weight_sync.bucket_size_mb`` -> :data:`TWIN_BUCKET_MB`); engine TP > 1 of the other families
(:data:`TWIN_ENGINE_TP`: the sync's engine-side split, each engine rank its own slice); the model's MTP layer
(the trainer's import drops it, SGLang's loader skips it and the engines' manifest leaves it out, as for the
recipe's checkpoint); block FP8 on the wire (the sender quantises, each engine rank receives its FP8 slice and
scale blocks, checked against the checkpoint; SGLang on CPU cannot run FP8 linears without Intel AMX, so the
engine serves the checkpoint's dequantisation and its receiver dequantises each slice before loading:
:mod:`megarl.rollout.dequantized_view`).
"""  # noqa: E501 - a table row is one line
from __future__ import annotations

import copy
import json
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.schema import TrainConfig
from megarl.launch.twin_features import expert_data_parallel_copies
from megarl.models.families import REFERENCE_FAMILY, all_families, find_family
from megarl.models.tiny import MTP_FAMILIES, tiny_families

WORLD_SIZE = 2
"""Trainer ranks of a CPU-scaled run."""
TWIN_BUCKET_MB = 2
"""The twin's ``weight_sync.bucket_size_mb``: the tiny model (~2 MiB) then syncs in ~5 buckets per stage
(they ramp up to it), with boundaries inside layers, as a recipe's 512-1024 MiB buckets cut a real model."""
TWIN_FP8_BLOCK = 16
"""The twin's ``weight_block_size`` edge where the recipe serves block FP8 (128 x 128 in DeepSeek-V3's release):
the tiny model's 32-128-row linears then span several blocks, and its TP 2 splits (trainer and engine) fall on
block boundaries as the recipe's do on 128."""
TWIN_ENGINE_TP = 2
"""The twin engine's TP where the recipe's engines have TP > 1 and its family is in :data:`ENGINE_TP2_FAMILIES`:
two SGLang CPU ranks, one core each (``SGLANG_CPU_OMP_THREADS_BIND``,
:func:`megarl.rollout.engine_resources.cpu_threads_bind`), so each engine rank receives and loads its own slice of
every bucket as the recipe's TP 4-32 ranks do. (A CPU engine pads the tiny models' ``moe_intermediate_size`` 32
to 64, so its rank 0 holds every expert and shared expert whole and rank 1 none: attention, embeddings and dense
MLPs are split; :mod:`megarl.weight_sync.engine_slices`.)"""
ENGINE_TP2_FAMILIES = tuple(f.name for f in all_families() if f.twin_engine_tp2)
"""Tiny families (``Family.twin_engine_tp2``) whose SGLang 0.5.23 CPU engine at TP 2 loads megarl's
pre-sharded updates: Qwen3-MoE and Qwen3 (a first step ran: Qwen3-30B-A3B's twin), DeepSeek-V3 (also
Kimi-K2's twin), GLM-4.5 and Kimi-K2.5 (engine = trainer after a p2p sync with the load proof:
``tests/integration/weight_sync/test_engine_tp2_families.py``). DeepSeek-V3's twin at engine TP 2 was refused
before (its shared expert's ``down_proj`` sent as [64, 16] per rank where a CPU engine, which pads
``moe_intermediate_size`` to a multiple of 64, holds [64, 32] on rank 0 and nothing on rank 1:
:mod:`megarl.weight_sync.engine_slices`). The others keep engine TP 1 and say so in a note."""


def _tiny_model(hf_path: str) -> tuple[str, list[str]]:
    """``(tiny uri, notes)`` for the recipe's model: a note when the family had to be guessed, and one
    for each structural feature of the recipe's model that the tiny one lacks (MTP layers where the family
    has no tiny MTP layer). A model with MTP layers gets a tiny one with one MTP layer (``mtp_layers=1``),
    dropped by the trainer's import and skipped by SGLang's loader as the recipe's are; a block-FP8 model a
    block-FP8 tiny one (``fp8_block=`` :data:`TWIN_FP8_BLOCK`), synced in FP8 as the recipe's engines are."""
    if hf_path.startswith("tiny:"):
        return hf_path, []
    config = Path(hf_path) / "config.json"
    if not config.is_file():
        return f"tiny:{REFERENCE_FAMILY}", [f"cpu-scale: model.hf_path {hf_path} has no config.json here: "
                                            f"using tiny:{REFERENCE_FAMILY} (megarl's reference family)"]
    hf = json.loads(config.read_text())
    model_type = hf.get("model_type")
    family = find_family(model_type)
    if family is None or family.name not in tiny_families():
        raise ValueError(f"model.hf_path: model_type {model_type!r} has no tiny family for --cpu-scale "
                         f"(known: {', '.join(tiny_families())})")
    text = family.text(hf)
    text = text if isinstance(text, dict) else hf
    notes, query = [], []
    mtp = int(text.get("num_nextn_predict_layers") or 0)
    if mtp > 0 and family.name in MTP_FAMILIES:  # the checkpoint carries them; trainer and engine skip them
        query.append("mtp_layers=1")
        if mtp > 1:
            notes.append(f"cpu-scale: num_nextn_predict_layers {mtp} -> 1 (tiny:{family.name} carries one MTP layer)")
    elif mtp > 0:
        notes.append(f"cpu-scale: num_nextn_predict_layers {mtp} -> 0 (tiny:{family.name} has no "
                     "multi-token-prediction layers to drop; the loaders' MTP skip is not exercised)")
    if hf.get("quantization_config") or text.get("quantization_config"):
        query.append(f"fp8_block={TWIN_FP8_BLOCK}")
    return f"tiny:{family.name}" + (f"?{'&'.join(query)}" if query else ""), notes


def _parallel(p: DictConfig, notes: list[str]) -> None:
    tp, pp = int(p.tensor_model_parallel_size), int(p.pipeline_model_parallel_size)
    ep = int(p.expert_model_parallel_size)
    if tp > 1:
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = WORLD_SIZE, 1
        if pp > 1:
            notes.append(f"cpu-scale: parallel.pipeline_model_parallel_size {pp} -> 1 (world size {WORLD_SIZE} "
                         "keeps tensor parallelism)")
    elif pp > 1:
        p.pipeline_model_parallel_size = WORLD_SIZE
    p.virtual_pipeline_model_parallel_size = None if int(p.pipeline_model_parallel_size) == 1 else \
        p.virtual_pipeline_model_parallel_size
    if int(p.context_parallel_size) > 1:
        notes.append(f"cpu-scale: parallel.context_parallel_size {p.context_parallel_size} -> 1 "
                     "(context parallelism needs Transformer Engine attention, CUDA)")
        p.context_parallel_size = 1
    p.expert_model_parallel_size = min(ep, WORLD_SIZE)
    p.expert_tensor_parallel_size = 1 if int(p.expert_model_parallel_size) > 1 else None
    if int(p.tensor_model_parallel_size) == 1:
        p.sequence_parallel = False


def _expert_copies(cfg: DictConfig) -> int | None:
    """The recipe's expert-data-parallel copies; None where its sizes are unset or invalid (validation
    reports those, naming the field)."""
    try:
        return expert_data_parallel_copies(cfg)
    except Exception:  # noqa: BLE001 - missing / non-integer / zero sizes: preflight names them
        return None


def cpu_scale(cfg: DictConfig) -> tuple[DictConfig, list[str]]:
    """The recipe ``cfg`` scaled down to one CPU host (see the module docstring for every change).

    Args:
        cfg: a loaded recipe (``megarl.config.load_config``), before ``tiny:`` paths are resolved.

    Returns:
        ``(scaled, notes)``: a new config (``cfg`` is not modified) and the ``cpu-scale:`` lines
        naming each feature switched off or reduced beyond size.

    Raises:
        ValueError: the recipe's model family has no tiny counterpart.
    """
    cfg = copy.deepcopy(cfg)
    notes: list[str] = []
    real_model, copies = not str(cfg.model.hf_path).startswith("tiny:"), _expert_copies(cfg)
    ep = int(cfg.parallel.expert_model_parallel_size)
    bucket_mb, engine_tp = int(cfg.weight_sync.bucket_size_mb), int(cfg.rollout.engine.tensor_parallel_size)
    _device_and_model(cfg, notes)
    _parallel(cfg.parallel, notes)
    family = str(cfg.model.hf_path).removeprefix("tiny:").partition("?")[0]
    if engine_tp > 1 and family not in ENGINE_TP2_FAMILIES:
        notes.append(f"cpu-scale: rollout.engine.tensor_parallel_size {engine_tp} -> 1 (tiny:{family} at engine TP "
                     f"{TWIN_ENGINE_TP} is not verified on SGLang's CPU backend: ENGINE_TP2_FAMILIES)")
        engine_tp = 1
    _one_host(cfg, engine_tp)
    _one_step(cfg, notes)
    if copies is not None and copies != expert_data_parallel_copies(cfg):
        notes.append(f"cpu-scale: parallel.expert_model_parallel_size {ep} -> {cfg.parallel.expert_model_parallel_size}"
                     f" on {WORLD_SIZE} ranks: {copies} expert-data-parallel copies of each expert -> "
                     f"{expert_data_parallel_copies(cfg)} (two ranks keep expert parallelism, not a second copy)")
    if real_model and bucket_mb != int(cfg.weight_sync.bucket_size_mb):
        notes.append(f"cpu-scale: weight_sync.bucket_size_mb {bucket_mb} -> {cfg.weight_sync.bucket_size_mb} (the "
                     f"tiny model is ~2 MiB: {TWIN_BUCKET_MB} MiB buckets give each stage several, cut inside layers, "
                     "as the recipe's buckets are)")
    return cfg, notes


def _device_and_model(cfg: DictConfig, notes: list[str]) -> None:
    """CPU, the tiny model (no checkpoint, no tokenizer of its own), CUDA-only features off, fp32."""
    m, t, c = cfg.model, cfg.train, cfg.cluster
    if str(c.device) != "cpu":
        notes.append(f"cpu-scale: cluster.device {c.device} -> cpu (Transformer Engine layer spec -> Megatron's "
                     "local spec, CUDA kernels off)")
    m.hf_path, model_notes = _tiny_model(str(m.hf_path))
    notes += model_notes
    m.tokenizer_path = None
    if m.load_dir:
        notes.append(f"cpu-scale: model.load_dir {m.load_dir} -> none (a checkpoint of the replaced model; the "
                     "tiny model starts from its own weights)")
        m.load_dir = None
    if m.moe_grouped_gemm:
        notes.append("cpu-scale: model.moe_grouped_gemm true -> false (grouped GEMM is CUDA-only)")
        m.moe_grouped_gemm = False
    if t.fp8 is not None:
        notes.append(f"cpu-scale: train.fp8 {t.fp8} ({t.fp8_recipe}) -> off (Transformer Engine FP8 needs a GPU)")
        t.fp8 = None
    t.fp8_recipe = TrainConfig.fp8_recipe  # inert without fp8: recipes that differ only here scale alike
    if c.gpu:
        notes.append(f"cpu-scale: cluster.gpu {c.gpu} -> none (the planner's GPU; the tiny model on CPU is "
                     "not planned against it)")
        c.gpu = None
    if t.precision not in ("fp32", "auto"):
        notes.append(f"cpu-scale: train.precision {t.precision} -> fp32 (CPU)")
    t.precision = "fp32"


def _one_host(cfg: DictConfig, engine_tp: int) -> None:
    """Trainer ranks and one engine (TP :data:`TWIN_ENGINE_TP` where the recipe's ``engine_tp`` > 1) on this
    host; short rollouts of 2 prompts x 2."""
    c, r = cfg.cluster, cfg.rollout
    tp = TWIN_ENGINE_TP if engine_tp > 1 else 1
    c.device, c.trainer_nodes, c.trainer_devices_per_node = "cpu", 1, WORLD_SIZE
    c.rollout_nodes, c.rollout_devices_per_node = 1, tp
    r.num_engines, r.external_engine_urls = 1, []
    e = r.engine
    e.tensor_parallel_size, e.expert_parallel_size, e.dtype = tp, 1, "float32"
    # The KV pool is max_total_tokens (SGLang caps its profiled capacity by it); the fraction is the
    # slack SGLang's CPU memory profile allows for what other processes allocate while the engine
    # loads: 0.05 left ~1 GB, and an engine beside a starting trainer was refused at start-up
    # ("Loaded weights leave no GPU memory for the KV cache"; kv_cache_configurator.py:2990-3007).
    e.mem_fraction_static, e.max_total_tokens, e.host = 0.2, 16384, "127.0.0.1"
    r.num_prompts_per_step, r.group_size, r.over_sample_prompts = 2, 2, min(int(r.over_sample_prompts), 1)
    r.sampling.max_new_tokens = min(int(r.sampling.max_new_tokens), 32)
    a = r.agent
    a.max_turns = min(int(a.max_turns), 2)
    a.max_response_tokens = min(int(a.max_response_tokens), 96)
    a.max_context_tokens = 1024  # the tiny model's template renders the tools' JSON schemas (~400 tokens)


def _one_step(cfg: DictConfig, notes: list[str]) -> None:
    """One RL step (and at most one SFT step) on small batches, no evaluation, checkpoints or plots."""
    t = cfg.train
    t.num_steps, t.global_batch_size = 1, 4
    if int(t.lr_warmup_steps) > 0:
        notes.append(f"cpu-scale: train.lr_warmup_steps {t.lr_warmup_steps} -> 0 (the run has one optimizer step)")
        t.lr_warmup_steps = 0
    t.max_tokens_per_microbatch = 2048 if t.max_tokens_per_microbatch is not None else None
    cfg.sft.num_steps = min(int(cfg.sft.num_steps), 1)
    cfg.sft.batch_size = min(int(cfg.sft.batch_size), 4)
    d = cfg.data
    d.max_prompt_tokens = 512
    d.max_eval_samples = 2 if d.max_eval_samples is None else min(int(d.max_eval_samples), 2)
    d.eval_samples_per_prompt = min(int(d.eval_samples_per_prompt), 1)
    if int(d.eval_interval) > 0:
        notes.append(f"cpu-scale: data.eval_interval {d.eval_interval} -> 0 (no evaluation rollouts; the run "
                     "is its first RL step)")
        d.eval_interval = 0
    if cfg.algorithm.filter_zero_variance_groups:
        notes.append("cpu-scale: algorithm.filter_zero_variance_groups -> false (a random tiny model's rewards "
                     "rarely vary within a group of 2; the first step must still train)")
        cfg.algorithm.filter_zero_variance_groups = False
    cfg.checkpoint.save_interval, cfg.checkpoint.hf_export_interval = 0, 0
    cfg.weight_sync.bucket_size_mb = min(int(cfg.weight_sync.bucket_size_mb), TWIN_BUCKET_MB)
    lg = cfg.logging
    lg.progress_bar, lg.wandb, lg.plots = False, False, False


def print_notes(notes: list[str]) -> None:
    """Print the ``cpu-scale:`` lines (stdout, so they land in the run's console log)."""
    for line in notes:
        print(line, flush=True)
    if not notes:
        print("cpu-scale: nothing switched off", flush=True)
