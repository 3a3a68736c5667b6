"""Directory converters: HF -> Megatron dist checkpoint (multi-process) and back (streaming).

``hf_to_megatron`` spawns one gloo process per rank of the requested layout; each builds its model
chunks on the meta device and, one group at a time (the embedding, each layer, the output layer),
materialises the group, fills it from the HF safetensors and saves it
(:class:`~megarl.conversion.dist_ckpt.StreamingCheckpointWriter`). ``megatron_to_hf_dir`` loads a
dist checkpoint (any layout it was saved at) group by group into a TP=1 meta model and streams the
HF tensors into pre-planned safetensors shards, split over ``ranks`` processes that each write
their own shards (:mod:`megarl.conversion.parallel_export`). Peak memory: a couple of layers per
rank, not the model. For an import launched from outside (one Slurm task or torchrun process per
rank), the same per-rank function runs in :mod:`megarl.conversion.dist_convert`.

Both write into a temporary sibling of the destination and rename it at the end: on any error
nothing is left at the destination. The checkpoint keeps the HF config, generation config and
tokenizer under ``hf_config/`` so that it can be exported without the original directory; trainer
checkpoints keep them in ``step_N/trainer/hf_config/`` too (:func:`copy_hf_metadata`, by the driver).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megarl.config.schema import ModelConfig, ParallelConfig

HF_CONFIG_SUBDIR = "hf_config"
MARKER_FILE = "megarl_checkpoint.json"
TRAINER_SUBDIR = "trainer"
"""A trainer checkpoint's model lives in ``step_N/trainer`` (``megarl.launch.run_state.TRAINER_DIR``)."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
RANK_PRELOAD = ("megarl.conversion.rank_preload",)
"""What the ranks' fork server imports once (``run_ranks(preload=...)``, :mod:`megarl.conversion.rank_preload`)."""


def copy_hf_metadata(src: Path, dst: Path) -> None:
    """Copy every non-weight file of an HF directory (config, generation config, tokenizer, template).

    A ``quantization_config`` is left out of the copied ``config.json``: the weights megarl writes
    beside it are never quantised (a block-FP8 source is dequantised on import).
    """
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(Path(src).iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, dst / item.name)
    config_file = dst / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        if config.pop("quantization_config", None) is not None:
            config_file.write_text(json.dumps(config, indent=2) + "\n")


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The dist checkpoint directory itself: ``path``, or ``path/trainer`` for a trainer step directory;
    a run's ``checkpoints/`` directory (it holds ``latest``) stands for its newest complete step.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or neither it nor ``path/trainer`` holds a
            Megatron dist checkpoint (``metadata.json`` and ``.metadata``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / "latest").is_file():  # a save_dir: the trainer writes `latest` after a step is complete
        path = path / (path / "latest").read_text().strip()
    for candidate in (path, path / TRAINER_SUBDIR):
        if (candidate / "metadata.json").is_file() and (candidate / ".metadata").is_file():
            return candidate
    raise FileNotFoundError(f"{path} is not a Megatron dist checkpoint (no metadata.json and .metadata in it "
                            f"or in {path / TRAINER_SUBDIR}); make one with `megarl convert hf-to-megatron`")


def _atomic_dir(out_dir: Path, overwrite: bool) -> Path:
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite)")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # not tempfile.mkdtemp: its 0700 would keep teammates out of the published directory
        return tmp
    except OSError as e:  # named after the output asked for, not the temporary sibling
        raise OSError(e.errno, f"cannot create it: {e.strerror}", str(out_dir)) from e


def _publish(tmp: Path, out_dir: Path) -> Path:
    out_dir = Path(out_dir).resolve()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _hf_precision(hf_config) -> str:
    dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")
    return _PRECISIONS.get(dtype.replace("torch.", ""), "fp32")


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                   expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                   virtual_pipeline_model_parallel_size: int | None = None,
                   make_vocab_size_divisible_by: int = 128, precision: str | None = None,
                   overwrite: bool = False, timeout_s: float = 3600.0) -> Path:
    """Convert an HF directory into a Megatron ``dist_checkpointing`` checkpoint at a layout.

    Args:
        hf_dir: HF model directory. out_dir: destination (must not exist unless ``overwrite``).
        tensor_model_parallel_size ... virtual_pipeline_model_parallel_size: the saving layout
            (Megatron's names; ETP None = TP). One process per rank of the smallest world that
            realises it is spawned.
        make_vocab_size_divisible_by: vocabulary padding unit (times TP).
        precision: ``fp32`` / ``bf16`` / ``fp16``; default: the HF config's dtype.
        timeout_s: limit for the whole conversion.

    Returns:
        The checkpoint directory.

    Raises:
        ConfigMismatchError: config.json disagrees with the weights (names field, values, file).
        CheckpointFileError: a missing or truncated shard. FileExistsError: destination not empty.
        megarl.procs.local_ranks.RankError: a rank failed (its traceback is in the message).
    """
    from megarl.procs.local_ranks import run_ranks

    plan = plan_import(hf_dir, tensor_model_parallel_size=tensor_model_parallel_size,
                       pipeline_model_parallel_size=pipeline_model_parallel_size,
                       expert_model_parallel_size=expert_model_parallel_size,
                       expert_tensor_parallel_size=expert_tensor_parallel_size,
                       virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by, precision=precision)
    tmp = _atomic_dir(Path(out_dir), overwrite)
    try:
        run_ranks(import_rank_worker, plan.world_size, timeout_s=timeout_s, args=plan.worker_args(tmp),
                  preload=RANK_PRELOAD)
        finish_import(plan, tmp)
        return _publish(tmp, Path(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class ImportPlan:
    """A validated HF -> Megatron conversion: its source, saving layout and world size.

    Attributes:
        hf_dir: resolved HF directory. hf_config: its transformers config.
        parallel: the saving layout. world_size: processes that realise it,
            ``lcm(TP*PP, ETP*EP*PP)`` (one per rank; no data-parallel replicas).
        make_vocab_size_divisible_by: vocabulary padding unit. precision: ``fp32``/``bf16``/``fp16``.
    """
    hf_dir: Path
    hf_config: Any
    parallel: ParallelConfig
    world_size: int
    make_vocab_size_divisible_by: int
    precision: str

    def worker_args(self, tmp: Path) -> tuple:
        """The arguments of :func:`import_rank_worker` after ``(rank, world_size)`` (picklable)."""
        return (str(self.hf_dir), str(tmp), asdict(self.parallel), self.make_vocab_size_divisible_by,
                self.precision)


def plan_import(hf_dir: str | os.PathLike, *, tensor_model_parallel_size: int = 1,
                pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                expert_tensor_parallel_size: int | None = None,
                virtual_pipeline_model_parallel_size: int | None = None,
                make_vocab_size_divisible_by: int = 128, precision: str | None = None) -> ImportPlan:
    """Check an HF directory against its config and the layout; see :func:`hf_to_megatron`.

    Raises:
        ConfigMismatchError / CheckpointFileError: as :func:`hf_to_megatron`.
        FileNotFoundError: ``hf_dir`` has no config.json.
        ValueError: expert parallelism asked of a model without experts.
    """
    from megarl.conversion.config_check import check_weights_match_config
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config

    hf_dir = Path(hf_dir).resolve()
    if not (hf_dir / "config.json").is_file():  # before transformers, which would try it as a hub id
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    hf_config = load_hf_config(hf_dir)
    check_weights_match_config(hf_dir, hf_config)
    if expert_model_parallel_size > 1 and not any(get_family(hf_config).architecture(hf_config)["moe_layers"]):
        raise ValueError(f"expert_model_parallel_size={expert_model_parallel_size} needs an MoE model; "
                         f"{hf_dir} ({hf_config.model_type}) has no experts")
    parallel = ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        sequence_parallel=tensor_model_parallel_size > 1, use_distributed_optimizer=False)
    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    world = math.lcm(tensor_model_parallel_size * pipeline_model_parallel_size,
                     etp * expert_model_parallel_size * pipeline_model_parallel_size)
    return ImportPlan(hf_dir, hf_config, parallel, world, make_vocab_size_divisible_by,
                      precision or _hf_precision(hf_config))


def finish_import(plan: ImportPlan, tmp: Path) -> None:
    """After every rank saved its shards into ``tmp``: add the HF metadata and the marker file."""
    copy_hf_metadata(plan.hf_dir, tmp / HF_CONFIG_SUBDIR)
    (tmp / MARKER_FILE).write_text(json.dumps({
        "format": "megatron-core dist_checkpointing (torch_dist), model weights only",
        "family": plan.hf_config.model_type, "source": str(plan.hf_dir), "precision": plan.precision,
        "parallel": asdict(plan.parallel), "make_vocab_size_divisible_by": plan.make_vocab_size_divisible_by,
        "hf_config": HF_CONFIG_SUBDIR}, indent=2) + "\n")


def megatron_to_hf_dir(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                       hf_config_dir: str | os.PathLike | None = None, dtype: str | None = None,
                       max_shard_bytes: int = 5 * 2**30, overwrite: bool = False, ranks: int = 1,
                       timeout_s: float | None = None) -> Path:
    """Export a Megatron dist checkpoint (model weights, any saving layout) to an HF directory.

    Writes safetensors shards (+ ``model.safetensors.index.json`` when more than one), and copies
    config.json, generation_config.json, tokenizer and chat-template files from the config source.
    ``ranks`` processes split the work (:mod:`megarl.conversion.parallel_export`): each reads its
    share of the layers and writes its own shards; the index is merged from what they return. The
    tensors are the same, byte for byte, whatever ``ranks``; only the cut into files differs.

    Args:
        ckpt_dir: a dist checkpoint (from :func:`hf_to_megatron`, or a trainer checkpoint: the step
            directory ``RUN/checkpoints/step_N`` or its ``trainer/``).
        out_dir: destination HF directory.
        hf_config_dir: HF directory with config and tokenizer; default ``ckpt_dir/hf_config``
            (both converter and trainer checkpoints carry one). When both exist they must agree
            (architecture fields).
        dtype: output dtype (``float32``, ``bfloat16``, ``float16``); default: the checkpoint's.
        max_shard_bytes: safetensors shard size limit.
        ranks: export processes (gloo ranks on this machine), each reading and writing ~1/ranks of
            the bytes.
        timeout_s: limit for the whole export; default: sized from the checkpoint's bytes
            (:func:`~megarl.conversion.parallel_export.export_timeout_s`).

    Raises:
        ConfigMismatchError: the configs disagree with each other or with the checkpoint's shapes.
        FileNotFoundError: not a dist checkpoint / no HF config. FileExistsError: destination not empty.
        ValueError: ``ranks`` < 1.
        megarl.procs.local_ranks.RankError: an export rank failed (traceback in the message) or the
            export ran past ``timeout_s``.
    """
    return megatron_to_hf_dir_on_nodes(ckpt_dir, out_dir, (), hf_config_dir=hf_config_dir, dtype=dtype,
                                       max_shard_bytes=max_shard_bytes, overwrite=overwrite, ranks=ranks,
                                       timeout_s=timeout_s)


def megatron_to_hf_dir_on_nodes(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, nodes: Sequence[str], *,
                                hf_config_dir: str | os.PathLike | None = None, dtype: str | None = None,
                                max_shard_bytes: int = 5 * 2**30, overwrite: bool = False, ranks: int = 1,
                                timeout_s: float | None = None) -> Path:
    """:func:`megatron_to_hf_dir` with its parts spread over a Ray cluster's ``nodes`` (the run's
    background HF export, :mod:`megarl.launch.hf_export`; no command-line form: it needs the run's Ray).

    Args:
        nodes: Ray node ids; with several, the parts run on them, at most ``ranks`` on each node, each
            writing into ``out_dir``, which like ``ckpt_dir`` must be on a filesystem every node mounts
            (:mod:`megarl.conversion.ray_export`); with fewer than two, all on this machine.
        The others: as :func:`megatron_to_hf_dir`'s.

    Raises:
        What :func:`megatron_to_hf_dir` raises; FileNotFoundError also when a node cannot see the
        checkpoint or ``out_dir``, and a TimeoutError (or the part's error, through Ray) when the
        parts on the nodes run past ``timeout_s``.
    """
    from megarl.conversion.parallel_export import write_merged_index

    if ranks < 1:
        raise ValueError(f"ranks={ranks}: the export needs at least one rank")
    ckpt_dir = resolve_checkpoint_dir(Path(ckpt_dir).resolve())
    config_dir = _checked_export_config(ckpt_dir, hf_config_dir)
    tmp = _atomic_dir(Path(out_dir), overwrite)
    try:
        parts = _export_parts((str(ckpt_dir), str(tmp), str(config_dir), dtype, max_shard_bytes), ranks,
                              timeout_s, nodes)
        write_merged_index(tmp, parts)
        copy_hf_metadata(config_dir, tmp)
        return _publish(tmp, Path(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_parts(args: tuple, ranks: int, timeout_s: float | None, nodes: Sequence[str]) -> list:
    """The export's parts, run (``args``: ``export_rank``'s after the rank) on this machine's ``ranks``
    processes, or on ``nodes`` when several (:mod:`megarl.conversion.ray_export`); their RankExports."""
    from megarl.conversion.parallel_export import checkpoint_bytes, export_rank, export_timeout_s
    from megarl.procs.local_ranks import run_ranks

    if len(nodes) > 1:
        from megarl.conversion.ray_export import export_parts_on_nodes

        return [r.part for r in export_parts_on_nodes(nodes, *args, max_ranks_per_node=ranks, timeout_s=timeout_s,
                                                      preload=RANK_PRELOAD)]
    if timeout_s is None:
        timeout_s = export_timeout_s(checkpoint_bytes(Path(args[0])), ranks)
    return run_ranks(export_rank, ranks, timeout_s=timeout_s, args=args, preload=RANK_PRELOAD)


def _checked_export_config(ckpt_dir: Path, hf_config_dir) -> Path:
    """The export's HF config directory, checked against the stored one and the checkpoint's shapes."""
    from megarl.conversion.config_check import check_checkpoint_matches_config, compare_configs
    from megarl.conversion.dist_ckpt import model_prefix, tensor_shapes
    from megarl.training.model import load_hf_config

    stored = ckpt_dir / HF_CONFIG_SUBDIR
    config_dir = Path(hf_config_dir).resolve() if hf_config_dir else stored
    if not (config_dir / "config.json").exists():
        hint = f"hf_config_dir / --hf-config {hf_config_dir}: not" if hf_config_dir else "no HF config:"
        raise FileNotFoundError(f"{hint} {config_dir / 'config.json'} is missing" +
                                ("" if hf_config_dir else " (pass --hf-config HF_DIR)"))
    if hf_config_dir and (stored / "config.json").exists():
        compare_configs(load_hf_config(stored), load_hf_config(config_dir),
                        expected_file=stored / "config.json", actual_file=config_dir / "config.json")
    shapes = tensor_shapes(ckpt_dir)
    check_checkpoint_matches_config(shapes, model_prefix(shapes), load_hf_config(config_dir),
                                    config_dir / "config.json", ckpt_dir)
    return config_dir


def import_rank_worker(rank, world_size, hf_dir, out_dir, parallel_dict, divisible_by, precision):
    """One rank of the import (torch.distributed initialised): see :func:`groups.import_rank`."""
    from megarl.conversion import groups

    groups.import_rank(hf_dir, out_dir, ParallelConfig(**parallel_dict),
                       ModelConfig(hf_path=hf_dir, make_vocab_size_divisible_by=divisible_by), precision)
