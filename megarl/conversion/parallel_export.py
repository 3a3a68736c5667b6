"""The Megatron -> HF export split over ranks: each rank reads its groups and writes its own shards.

Every rank of :func:`megarl.conversion.convert.megatron_to_hf_dir` builds the same TP=1 meta model
and plans every HF tensor of it (name, dtype, shape: the same list the single-rank export writes,
in the same order). :func:`plan_rank_exports` cuts that list, at group boundaries (the embedding,
one layer, the final norm + output layer), into ``world_size`` consecutive parts of about equal
bytes; rank ``r`` reads only its part's groups from the dist checkpoint and writes its part's
safetensors shards, numbered after those of ranks ``< r`` (every rank computes every part, so no
collective is needed to name the files). The ranks return their shards; the caller merges them
into one ``model.safetensors.index.json`` (:func:`write_merged_index`).

The tensors, dtypes and names are those of the single-rank export, byte for byte; only the cut into
files differs (a shard never spans two ranks). With one rank the files are the single-rank export's.
Since a part needs nothing from the others, the parts can run on different machines: the run's
export over a Ray cluster's nodes runs each node's parts as a local group, told their global part
indices (:mod:`megarl.conversion.ray_export`).

Timeout: :func:`export_timeout_s` sizes the wall-clock limit from the bytes each rank writes and a
floor rate far under the measured one (``tools/benchmarks/hf_export.md``), plus the ranks' start-up:
a healthy export of any size finishes well inside it, a hung one (a stalled filesystem) is ended
and retried by :class:`megarl.launch.hf_export.BackgroundExport` instead of blocking, forever, the
driver's wait before the next checkpoint commit.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EXPORT_FLOOR_BYTES_PER_S = 20e6
"""Per-rank export rate the timeout assumes: 1/5 to 1/14 of what a rank measured on 2 CPU cores at
load average 7 (108-289 MB/s, ``tools/benchmarks/hf_export.md``)."""
EXPORT_STARTUP_S = 600.0
"""Start-up allowance of the timeout: forking the ranks, Megatron's parallel state, the meta model."""

Entry = tuple[str, torch.dtype, tuple]
"""One planned HF tensor: ``(name, dtype, shape)``."""


def entry_bytes(entry: Entry) -> int:
    """Bytes of one planned tensor."""
    _, dtype, shape = entry
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RankExport:
    """One rank's part of the export.

    Attributes:
        groups: indices of the module groups this rank reads (consecutive; may be empty).
        files: its safetensors file names, in the export's global numbering.
        shards: the ``(name, dtype, shape)`` entries of each file, in write order.
    """
    groups: tuple[int, ...]
    files: tuple[str, ...]
    shards: tuple[tuple[Entry, ...], ...]


def split_groups(group_bytes: Sequence[int], world_size: int) -> list[int]:
    """The rank that exports each group: consecutive groups, about ``total / world_size`` bytes each.

    A group goes to the rank whose byte range holds its middle byte, so every rank's bytes differ
    from the even share by at most half of a group on each side.

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: the export needs at least one rank")
    total = sum(group_bytes) or 1
    owners, before = [], 0
    for nbytes in group_bytes:
        owners.append(min(world_size - 1, int((before + nbytes / 2) * world_size // total)))
        before += nbytes
    return owners


def plan_rank_exports(group_entries: Sequence[Sequence[Entry]], world_size: int,
                      max_shard_bytes: int) -> list[RankExport]:
    """Every rank's groups and shards (the same answer on every rank).

    Args:
        group_entries: the HF tensors each module group produces, in model order.
        world_size: export ranks.
        max_shard_bytes: safetensors shard size limit (a larger single tensor gets its own shard).

    Returns:
        One :class:`RankExport` per rank; their files, concatenated, are the export's files.
    """
    from megarl.conversion.hf_io import plan_shards, shard_file_names

    owners = split_groups([sum(entry_bytes(e) for e in entries) for entries in group_entries], world_size)
    mine = [[g for g, owner in enumerate(owners) if owner == rank] for rank in range(world_size)]
    shards = [plan_shards([e for g in groups for e in group_entries[g]], max_shard_bytes) for groups in mine]
    files = shard_file_names(sum(len(s) for s in shards))
    parts, start = [], 0
    for groups, rank_shards in zip(mine, shards):
        parts.append(RankExport(tuple(groups), tuple(files[start:start + len(rank_shards)]),
                                tuple(tuple(shard) for shard in rank_shards)))
        start += len(rank_shards)
    return parts


def write_merged_index(out_dir: Path, parts: Sequence[RankExport]) -> None:
    """Write the one ``model.safetensors.index.json`` of the ranks' shards (none for a single file).

    Raises:
        ValueError: two ranks wrote the same file or the same tensor name.
    """
    from megarl.conversion.hf_io import write_index

    files = [f for part in parts for f in part.files]
    shards = [s for part in parts for s in part.shards]
    names = [name for shard in shards for name, _, _ in shard]
    if len(set(files)) != len(files) or len(set(names)) != len(names):
        raise ValueError(f"{out_dir}: the export ranks' shards overlap (files {files})")
    write_index(Path(out_dir), shards, files)


def export_timeout_s(total_bytes: int, world_size: int) -> float:
    """Wall-clock limit of an export of ``total_bytes`` by ``world_size`` ranks, in seconds."""
    return EXPORT_STARTUP_S + total_bytes / world_size / EXPORT_FLOOR_BYTES_PER_S


def ranks_within_memory(total_bytes: int, num_layers: int, available_bytes: int, ranks: int) -> int:
    """At most ``ranks`` export ranks, fewer where ``available_bytes`` of host memory cannot hold
    what each has in flight: two groups (one read, one being written) and a dtype-cast copy, a group
    estimated as ``total_bytes / num_layers`` (a DeepSeek-V3 MoE layer: ~22 GB in bf16, ~66 GB per
    rank). Never fewer than one."""
    per_rank = 3 * total_bytes / max(1, num_layers)
    return max(1, min(int(ranks), int(available_bytes // per_rank) if per_rank else int(ranks)))


def available_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def checkpoint_bytes(ckpt_dir: Path) -> int:
    """Bytes of the model tensors a dist checkpoint holds (its metadata; nothing is read)."""
    from megarl.conversion.dist_ckpt import tensor_shapes

    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in tensor_shapes(ckpt_dir).values())


def _hf_fp32_modules(hf_config) -> set[str]:
    """Module names transformers keeps in fp32 whatever the model dtype
    (``_keep_in_fp32_modules_strict``, e.g. DeepSeek-V3's ``e_score_correction_bias``)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    return set(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ())


class _ExportModel:
    """The TP=1 meta model of a checkpoint and its HF tensors, group by group (one export rank)."""

    def __init__(self, ckpt_dir: str, config_dir: str, dtype) -> None:
        from megarl.config.schema import ModelConfig, ParallelConfig
        from megarl.conversion.dist_ckpt import model_prefix, tensor_shapes
        from megarl.conversion.groups import _local_infos, module_groups
        from megarl.models.families import get_family
        from megarl.training.model import build_model, load_hf_config
        from megarl.training.parallel_state import initialize_parallel

        shapes = tensor_shapes(ckpt_dir)
        self.prefix = model_prefix(shapes)
        hf_config = load_hf_config(config_dir)
        (padded_vocab, _), ckpt_dtype = shapes[self.prefix + "embedding.word_embeddings.weight"]
        precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[ckpt_dtype]
        self.out_dtype = getattr(torch, dtype) if dtype else ckpt_dtype
        ps = initialize_parallel(ParallelConfig(), backend="gloo")  # world_size ranks: data-parallel replicas
        self.chunks = build_model(hf_config, ParallelConfig(), ModelConfig(make_vocab_size_divisible_by=padded_vocab),
                                  precision=precision, device="meta", spec="local")
        self.layout = get_family(hf_config).layout(hf_config, make_vocab_size_divisible_by=padded_vocab)
        self.infos = _local_infos(self.chunks, ps, self.layout)
        self.groups = module_groups(self.chunks)
        # Importing the modeling module costs ~1 s; it only matters when the output is not fp32.
        self.fp32_modules = _hf_fp32_modules(hf_config) if self.out_dtype != torch.float32 else set()

    def dtype_of(self, name: str) -> torch.dtype:
        """The output dtype of HF tensor ``name``."""
        return torch.float32 if self.fp32_modules & set(name.split(".")) else self.out_dtype

    def named(self, k: int) -> list:
        """``(local name, parameter)`` of group ``k``."""
        from megarl.conversion.groups import _group_params

        index, modules = self.groups[k]
        return _group_params(self.chunks[index], [p for m in modules for p in m.parameters()])

    def hf_tensors(self, k: int, named) -> Iterator[tuple[str, torch.Tensor]]:
        """Group ``k``'s ``(local name, tensor)`` pairs as HF ``(name, tensor)`` pairs."""
        from megarl.models.mapping import megatron_to_hf

        index, _ = self.groups[k]
        return megatron_to_hf([(self.infos[(index, n)].global_name, t) for n, t in named], self.layout)

    def entries(self, k: int) -> list[Entry]:
        """Group ``k``'s planned HF tensors."""
        return [(name, self.dtype_of(name), tuple(t.shape)) for name, t in self.hf_tensors(k, self.named(k))]


def export_rank(rank: int, world_size: int, ckpt_dir: str, out_dir: str, config_dir: str, dtype,
                max_shard_bytes: int) -> RankExport:
    """One rank of ``megatron_to_hf_dir`` (torch.distributed initialised, gloo): read this rank's
    groups, write this rank's shards into ``out_dir``; returns its part for the merged index."""
    from megarl.conversion.dist_ckpt import CheckpointReader
    from megarl.conversion.fastio import StoragePool
    from megarl.conversion.groups import _Background, group_sharded_state_dict
    from megarl.training.parallel_state import destroy_parallel

    model = _ExportModel(ckpt_dir, config_dir, dtype)
    part = plan_rank_exports([model.entries(k) for k in range(len(model.groups))], world_size,
                             max_shard_bytes)[rank]
    reader, pool = CheckpointReader(ckpt_dir), StoragePool()
    sink, background = _ShardSink(Path(out_dir), part.files, part.shards), _Background()
    try:  # group k is read (here) while the group before it is written (in the background thread)
        for k in part.groups:
            index, modules = model.groups[k]
            # Shape-only (meta) ShardedTensors describe what to read; the reader allocates the data.
            wanted = group_sharded_state_dict(model.chunks[index], modules, prefix=model.prefix,
                                              materialized_only=False)
            loaded = reader.load(wanted, allocate=functools.partial(pool.empty, group=k))
            loaded = {key[len(model.prefix):]: v for key, v in loaded.items()}
            items = [(name, t.to(model.dtype_of(name)))
                     for name, t in model.hf_tensors(k, [(n, loaded[n]) for n, _ in model.named(k)])]
            background.submit(sink.write_all, items, done=functools.partial(pool.release, k))
            del wanted, loaded, items
        background.drain()
    finally:
        background.shutdown()
    sink.close()
    reader.close()
    destroy_parallel()
    return part


class _ShardSink:
    """Writes planned HF tensors, in order, into the planned safetensors shards."""

    def __init__(self, out_dir: Path, files, shards):
        self._todo = iter(list(zip(files, shards)))
        self._out_dir, self._remaining = out_dir, 0
        self._current: Any = None  # the SafetensorsStreamWriter of the file being written

    def write_all(self, items) -> None:
        from megarl.conversion.hf_io import SafetensorsStreamWriter

        for name, tensor in items:
            if self._remaining == 0:
                self.close()
                file, shard = next(self._todo)
                self._current, self._remaining = SafetensorsStreamWriter(self._out_dir / file, shard), len(shard)
            self._current.write(name, tensor)
            self._remaining -= 1

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

