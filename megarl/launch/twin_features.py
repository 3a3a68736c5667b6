"""The structural features of a run that shape the weight sync and the loaders (issue 34, part 4).

A ``--cpu-scale`` twin (:mod:`megarl.launch.cpu_scale`) should keep them, or say in a ``cpu-scale:``
line that it does not: ``tests/unit/launch/test_cpu_scale_twins.py`` compares each GPU recipe's
features with its twin's. :data:`FIELDS` names, for each feature, the config field (of the run config
or of the model's ``config.json``) that a ``cpu-scale:`` line must name when the twin differs.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from megarl.models.families import find_family

FIELDS: dict[str, str] = {
    "model_type": "model_type",
    "mla_q_lora_rank": "q_lora_rank",
    "dense_first_layers": "first_k_dense_replace",
    "shared_experts": "n_shared_experts",
    "mtp_layers": "num_nextn_predict_layers",
    "engine_tp_above_1": "rollout.engine.tensor_parallel_size",
    "engine_block_fp8": "quantization_config",
    "one_expert_data_parallel_copy": "parallel.expert_model_parallel_size",
    "several_buckets_per_stage": "weight_sync.bucket_size_mb",
}
"""Feature -> the field a ``cpu-scale:`` note names when the twin changes that feature."""


def _model_config(hf_path: str) -> tuple[dict, dict]:
    """``(config.json, its language model's section)`` of a resolved model directory.

    Raises:
        FileNotFoundError: ``model.hf_path`` has no ``config.json``.
    """
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.hf_path: {hf_path} has no config.json (resolve tiny: paths first)")
    config = json.loads(path.read_text())
    family = find_family(config.get("model_type"))
    text = family.text(config) if family is not None else config
    return config, text if isinstance(text, dict) else config


def expert_data_parallel_copies(cfg: Any) -> int:
    """Copies of each expert shard among the trainer ranks: ``world / (ETP * EP * PP)``, ETP defaulting
    to TP as in Megatron-Core (:attr:`megarl.weight_sync.layout.TrainerLayout.expert_data_parallel_size`).
    """
    p, c = cfg.parallel, cfg.cluster
    world = int(c.trainer_nodes) * int(c.trainer_devices_per_node)
    etp = int(p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
    return world // (etp * int(p.expert_model_parallel_size) * int(p.pipeline_model_parallel_size))


def min_buckets_per_stage(cfg: Any) -> int:
    """The fewest sync buckets any pipeline stage sends (:func:`megarl.weight_sync.predict.plan_from_config`,
    metadata only: reads ``model.hf_path``'s ``config.json``)."""
    from megarl.weight_sync.predict import plan_from_config

    per_stage = Counter(b.pp_rank for b in plan_from_config(cfg).buckets)
    return min(per_stage.values()) if per_stage else 0


def structural_features(cfg: Any) -> dict[str, Any]:
    """The features of a resolved run config (``model.hf_path`` a directory) named in :data:`FIELDS`.

    Values: ``model_type`` (str, the top-level ``config.json`` one), ``mtp_layers`` (int,
    ``num_nextn_predict_layers``), the others bool: MLA with ``q_lora_rank`` set, ``first_k_dense_replace``
    > 0, ``n_shared_experts`` > 0, engine TP > 1, a ``quantization_config`` (block-FP8 engines and wire,
    :mod:`megarl.weight_sync.fp8_wire`), exactly one expert-data-parallel copy, and at least two buckets in
    every pipeline stage.

    Raises:
        FileNotFoundError: ``model.hf_path`` has no ``config.json``.
    """
    config, text = _model_config(str(cfg.model.hf_path))
    return {
        "model_type": config.get("model_type"),
        "mla_q_lora_rank": bool(text.get("q_lora_rank")),
        "dense_first_layers": int(text.get("first_k_dense_replace") or 0) > 0,
        "shared_experts": int(text.get("n_shared_experts") or 0) > 0,
        "mtp_layers": int(text.get("num_nextn_predict_layers") or 0),
        "engine_tp_above_1": int(cfg.rollout.engine.tensor_parallel_size) > 1,
        "engine_block_fp8": bool(config.get("quantization_config") or text.get("quantization_config")),
        "one_expert_data_parallel_copy": expert_data_parallel_copies(cfg) == 1,
        "several_buckets_per_stage": min_buckets_per_stage(cfg) > 1,
    }
