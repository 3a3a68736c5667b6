"""Trainer-side checks that make a wrong weight push an error instead of a silent success.

SGLang 0.5.23 ignores tensor names it does not know and still answers ``success`` (so a misnamed
tensor leaves stale weights), and an exception inside its loader kills the server. Everything is
therefore checked here, before a byte is sent:

1. :func:`check_plan_against_manifest` (once per plan): the plan's wire tensors and the engine's
   checkpoint (``model.safetensors`` headers of the served model) have the same names, shapes and
   dtypes: an unknown name, a missing tensor or a shape / dtype mismatch is an error.
2. :func:`check_local_params` (once per plan, every rank): this rank holds every shard the plan
   says it sends, with the planned shape and dtype.
3. :class:`~megarl.weight_sync.copy_instructions.Placement` (once per parameter kind): the family's
   conversion, traced, produces exactly the planned HF shapes.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch

from megarl.models.families import find_family, text_config_of
from megarl.rollout.engine_view import EMBEDDING, OUTPUT_LAYER, needs_untied_view
from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.stacked_experts import stacked_specs

Manifest = dict[str, tuple[tuple[int, ...], str]]
"""HF tensor name -> (shape, dtype name without ``torch.``)."""

_T = TypeVar("_T")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "I64": "int64", "I32": "int32", "U8": "uint8"}


class WeightSyncError(RuntimeError):
    """A weight sync that must not be reported as a success (names the tensor and the problem)."""


def required(value: _T | None, what: str) -> _T:
    """``value``, set only on some trainer ranks (a transport on senders, the engines on the
    coordinator), where a caller needs it.

    Raises:
        WeightSyncError: ``value`` is None (names ``what``).
    """
    if value is None:
        raise WeightSyncError(f"weight sync: {what} is not set on this trainer rank")
    return value


def read_manifest(model_dir: str | os.PathLike) -> Manifest:
    """Names, shapes and dtypes of every tensor an engine serving ``model_dir`` holds: its safetensors
    files' tensors (headers only; of a vision-language release, those under its family's ``hf_prefix``:
    megarl trains and syncs the language model, the engine keeps its vision tower; without the
    multi-token-prediction layers of a checkpoint that has them, :func:`mtp_layer_names`), and
    ``lm_head.weight`` (the embedding's shape and dtype) for a tied
    checkpoint whose SGLang class keeps its own output layer (:mod:`megarl.rollout.engine_view`: the
    engines megarl starts serve an untied view; every sync delivers that tensor).

    Raises:
        WeightSyncError: no safetensors file in ``model_dir``.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightSyncError(f"no *.safetensors in {model_dir}: cannot check tensor names against the engine")
    manifest: Manifest = {}
    for path in files:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                manifest[name] = (tuple(info["shape"]), _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]))
    config = Path(model_dir) / "config.json"
    hf_config = json.loads(config.read_text()) if config.is_file() else {}
    if needs_untied_view(hf_config) and EMBEDDING in manifest:
        manifest.setdefault(OUTPUT_LAYER, manifest[EMBEDDING])
    family = find_family(hf_config.get("model_type"))
    if family is not None and family.hf_prefix:  # a vision-language release: the language model only
        manifest = {name: v for name, v in manifest.items() if name.startswith(family.hf_prefix)}
    text = text_config_of(hf_config)
    mtp = mtp_layer_names(manifest, text if isinstance(text, dict) else hf_config)
    return {name: v for name, v in manifest.items() if name not in mtp}


_LAYER = re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.")


def mtp_layer_names(names, text_config: Mapping) -> set[str]:
    """The tensors of ``names`` in a multi-token-prediction layer: HF ``model.layers.{L}.*`` (under any
    prefix) with ``num_hidden_layers <= L < num_hidden_layers + num_nextn_predict_layers`` of
    ``text_config`` (a config.json's language-model section).

    Neither side holds them as decoder weights: megarl's import drops them (the DeepSeek-V3 family's
    ``note_mtp_layers``) and SGLang 0.5.23's DeepSeek-V3 and GLM-4.5 loaders skip layers at or past
    ``num_hidden_layers`` unless they load the NextN draft model (``deepseek_weight_loader.py``,
    ``glm4_moe.py`` ``load_weights``); an engine serving them for speculative decoding would keep them
    stale, which megarl does not start. Left in the manifest they would be reported as engine tensors
    the plan never sends.
    """
    count = int(text_config.get("num_nextn_predict_layers") or 0)
    if count <= 0:
        return set()
    first = int(text_config["num_hidden_layers"])
    out = set()
    for name in names:
        match = _LAYER.match(name)
        if match is not None and first <= int(match.group(1)) < first + count:
            out.add(name)
    return out


def check_plan_against_manifest(plan: WeightSyncPlan, manifest: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Every planned tensor is known to the engine with the same shape and dtype, and none is missing.

    Raises:
        WeightSyncError: lists unknown names, missing tensors and shape / dtype mismatches.
    """
    # FP8 weights and scales for a block-FP8 engine; an expert stack's slices as the stack the engine loads
    planned = {t.name: t for t in stacked_specs(list(plan.wire_tensors()))}
    problems = []
    unknown = sorted(set(planned) - set(manifest))
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) unknown to the engine (SGLang would silently skip them): "
                        f"{unknown[:5]}")
    missing = sorted(set(manifest) - set(planned))
    if missing:
        problems.append(f"{len(missing)} engine tensor(s) the plan never sends (they would stay stale): {missing[:5]}")
    for name in sorted(set(planned) & set(manifest)):
        shape, dtype = manifest[name]
        t = planned[name]
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(t.shape)} planned, engine checkpoint has {tuple(shape)}")
        if t.dtype != dtype:
            problems.append(f"{name}: dtype {t.dtype} planned, engine checkpoint has {dtype}")
    if problems:
        raise WeightSyncError("weight sync plan does not match the engine's model: " + "; ".join(problems))


def check_local_params(plan: WeightSyncPlan, rank: int, local: Mapping[str, torch.Tensor]) -> None:
    """This rank holds every shard the plan has it send, with the planned shape and dtype.

    Args:
        local: global Megatron name -> this rank's shard (``Trainer.named_parameters_for_sync()``).

    Raises:
        WeightSyncError: a planned shard is missing or has another shape / dtype.
    """
    for bucket in plan.buckets:
        for transfer, source in bucket.contributions(rank):
            name = transfer.param.name
            if name not in local:
                raise WeightSyncError(f"trainer rank {rank} does not hold {name!r} (shard {source.shard_index}) "
                                      f"although the plan sends it from there")
            tensor = local[name]
            if tuple(tensor.shape) != tuple(source.shape):
                raise WeightSyncError(f"{name} on trainer rank {rank}: shape {tuple(tensor.shape)}, "
                                      f"the plan expects shard shape {tuple(source.shape)}")
            if str(tensor.dtype).removeprefix("torch.") != transfer.param.dtype:
                raise WeightSyncError(f"{name} on trainer rank {rank}: dtype {tensor.dtype}, "
                                      f"the plan expects {transfer.param.dtype}")
