"""Write a Megatron ``dist_checkpointing`` (torch_dist) checkpoint in steps, a few layers at a time.

``dist_checkpointing.save`` writes a whole sharded state dict in one collective call, so the model
must be in memory. :class:`StreamingCheckpointWriter` instead saves one group of parameters per
step (each step a torch.distributed.checkpoint save of Megatron's translated state dict, with
Megatron's own key translation and planner, files prefixed by the step) and, at the end, merges the
steps' metadata into the single ``.metadata`` a normal save writes, plus ``common.pt`` and
``metadata.json``. The result is an ordinary Megatron checkpoint: ``dist_checkpointing.load``
reads it at any parallel layout.

Uses Megatron-Core 0.16.1 internals (``mcore_to_pyt_state_dict``, ``MCoreSavePlanner``), guarded by
:func:`megarl.training.cpu_compat.check_megatron_version`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megarl.training.collectives import barrier


class _StepWriter(FileSystemWriter):
    """A FileSystemWriter whose data files carry a step prefix and which leaves ``.metadata`` alone."""

    def __init__(self, path: str, step: int):
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.step = step

    def prepare_global_plan(self, plans):
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_s{self.step:05d}_"))
                for i, plan in enumerate(plans)]

    def finish(self, metadata: Metadata, results) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}


@contextlib.contextmanager
def _no_crc32():
    """``torch.save`` without the zip records' CRC-32 (a pass over every byte; ``torch.load``
    does not check it: torch builds miniz with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _partial_planner():
    """Megatron's save planner without torch's per-save "tensor fully covered" validation: a step
    holds only some layers of a stacked ``decoder.layers.*`` tensor. Coverage is checked on the
    merged metadata in :meth:`StreamingCheckpointWriter.finalize` instead."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    class _PartialSavePlanner(MCoreSavePlanner):
        def _create_global_plan(self, all_plans):
            return create_default_global_save_plan(self._dedup_save_plans(all_plans))

    return _PartialSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                               can_run_decentralized_global_plan=False)


def _without_prepended_axes(value):
    """Express stacked-layer ShardedTensors (``prepend_axis_num > 0``) with explicit unit axes.

    Megatron translates prepended-axis tensors through torch's legacy ShardedTensor, which needs
    every grid fragment a rank owns in one save; a step holds only some layers. The same global
    region, written as a plain ShardedTensor, goes through DCP's chunk-based path; the files and
    metadata describe the same global tensor and chunks.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(value, dict):
        return {k: _without_prepended_axes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_prepended_axes(v) for v in value]
    if isinstance(value, ShardedTensor) and value.prepend_axis_num:
        shape = (1,) * value.prepend_axis_num + tuple(value.local_shape)
        value = dataclasses.replace(value, data=value.data.reshape(shape), local_shape=shape,
                                    prepend_axis_num=0)
    if isinstance(value, ShardedTensor):
        value = dataclasses.replace(value, data=_own_storage(value.data))
    return value


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous view of part of a larger CPU storage (e.g. the gate half of a GLU
    ``linear_fc1`` that Megatron's factory splits off) as a tensor whose storage is exactly its
    bytes, sharing the memory: torch.distributed.checkpoint then saves it without a clone (it
    clones any tensor whose storage is larger than the tensor, since ``torch.save`` would write
    the whole storage)."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0
            or tensor.untyped_storage().nbytes() == tensor.nbytes):
        return tensor
    raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.view(-1).view(torch.uint8)
    buffer = memoryview(raw.reshape(-1).numpy())  # type: ignore[arg-type]  # ndarray: a buffer
    return torch.frombuffer(buffer, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)


def _merge(into: Metadata | None, step: Metadata) -> Metadata:
    if into is None:
        return step
    for key, meta in step.state_dict_metadata.items():
        if key not in into.state_dict_metadata:
            into.state_dict_metadata[key] = meta
        elif isinstance(meta, TensorStorageMetadata):
            have = cast(TensorStorageMetadata, into.state_dict_metadata[key])
            if tuple(have.size) != tuple(meta.size):
                raise ValueError(f"{key}: global shape {tuple(meta.size)} differs from {tuple(have.size)}")
            have.chunks.extend(meta.chunks)
    into.storage_data.update(step.storage_data)
    if isinstance(into.planner_data, dict) and isinstance(step.planner_data, dict):
        into.planner_data.update(step.planner_data)
    for attr in ("mcore_data",):
        if isinstance(getattr(step, attr, None), dict):
            merged = dict(getattr(into, attr, None) or {})
            merged.update(getattr(step, attr))
            setattr(into, attr, merged)
    return into


class StreamingCheckpointWriter:
    """Collective, step-wise writer of one Megatron dist checkpoint.

    Every rank calls :meth:`save_step` the same number of times (with an empty dict when it has
    nothing for that step), then :meth:`finalize`. Collectives run on the default process group.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike):
        from megarl.training.cpu_compat import check_megatron_version

        check_megatron_version()
        self.dir = Path(checkpoint_dir)
        self.step = 0
        self.metadata: Metadata | None = None
        self.common: dict = {}

    def save_step(self, sharded_state_dict: dict) -> None:
        """Save one group of Megatron ``ShardedTensor``\\s (e.g. one layer's ``sharded_state_dict``
        entries). Access integrity is validated once over all steps' chunks in :meth:`finalize`."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.core.dist_checkpointing.strategies.torch import (
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )
        from torch.distributed.checkpoint import save as dcp_save

        sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        sharded = _without_prepended_axes(sharded)
        self.common.update(common)
        grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(grouped, False)
        with _no_crc32():
            step_metadata = dcp_save(
                pyt_state_dict, storage_writer=_StepWriter(str(self.dir), self.step), planner=_partial_planner())
        self.metadata = _merge(self.metadata, step_metadata)
        self.step += 1

    def finalize(self) -> None:
        """Write the merged ``.metadata``, ``common.pt`` and ``metadata.json`` (rank 0), then barrier.

        Raises:
            ValueError: some tensor's chunks do not cover it exactly once.
        """
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        if dist.get_rank() == 0:
            metadata = self.metadata or Metadata(state_dict_metadata={}, storage_data={})
            check_coverage(metadata)
            metadata.version = CURRENT_DCP_VERSION
            tmp = self.dir / ".metadata.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(metadata, f)
            tmp.rename(self.dir / ".metadata")
            TorchCommonSaveStrategy("torch", 1).save_common(self.common, self.dir)
            save_config(CheckpointingConfig("torch_dist", 1), str(self.dir))
        barrier()


def check_coverage(metadata: Metadata) -> None:
    """Every tensor's chunks must tile its global shape exactly (no gap, no overlap).

    Raises:
        ValueError: names the first tensor with a gap or an overlap.
    """
    from torch.distributed.checkpoint.default_planner import _validate_global_plan

    errors = _validate_global_plan([], metadata)  # torch's own check: bounds and overlaps
    if errors:
        raise ValueError(f"merged checkpoint metadata is invalid: {'; '.join(errors)[:1000]}")
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        total = torch.Size(meta.size).numel()
        covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
        offsets = {tuple(c.offsets) for c in meta.chunks}
        if covered != total or len(offsets) != len(meta.chunks):
            raise ValueError(f"checkpoint tensor {key}: chunks cover {covered} of {total} elements "
                             f"({len(meta.chunks)} chunks, {len(offsets)} distinct offsets)")


def tensor_shapes(checkpoint_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor in a torch_dist checkpoint (reads ``.metadata`` only).

    Raises:
        FileNotFoundError: not a Megatron dist checkpoint (names the missing file).
    """
    path = Path(checkpoint_dir)
    for name in ("metadata.json", ".metadata"):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found: {path} is not a Megatron dist checkpoint")
    metadata = FileSystemReader(str(path)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def model_prefix(shapes: dict) -> str:
    """The key prefix under which a checkpoint stores the model (``""``, or e.g. ``"model."``);
    optimizer state keys (``optimizer.…``) are not the model.

    Raises:
        ValueError: no (or more than one) embedding key.
    """
    suffix = "embedding.word_embeddings.weight"
    found = [k[: -len(suffix)] for k in shapes if k.endswith(suffix)]
    # A trainer checkpoint also holds the optimizer's copies (``optimizer.state.exp_avg.…``).
    models = [p for p in found if not p.startswith("optimizer.")]
    if len(models) != 1:
        raise ValueError(f"cannot locate the model in the checkpoint: {len(found)} keys end with {suffix} "
                         f"({sorted(found)})")
    return models[0]


class CheckpointReader:
    """Read arbitrary regions of tensors from a torch_dist checkpoint, chunk by chunk.

    Loads only the saved chunks that overlap the requested region (whatever layout saved them), so
    memory is bounded by the region plus one saved chunk. Used by the export instead of
    ``dist_checkpointing.load``, which cannot load part of a stacked ``decoder.layers.*`` tensor.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike):
        self.dir = Path(checkpoint_dir)
        self.metadata = FileSystemReader(str(self.dir)).read_metadata()

    def _fd(self, relative_path: str) -> int:
        fds = self.__dict__.setdefault("_fds", {})
        if relative_path not in fds:
            fds[relative_path] = os.open(self.dir / relative_path, os.O_RDONLY)
        return fds[relative_path]

    def close(self) -> None:
        """Close the checkpoint files opened so far."""
        for fd in self.__dict__.pop("_fds", {}).values():
            os.close(fd)

    def _chunk(self, key: str, chunk, out: torch.Tensor | None = None) -> torch.Tensor:
        """One saved chunk, read straight into ``out`` when given and of the chunk's dtype and
        shape (else a new tensor, copied into ``out`` when given)."""
        import io

        from torch.distributed.checkpoint.metadata import MetadataIndex

        from megarl.conversion.fastio import read_torch_save_tensor

        info = self.metadata.storage_data[MetadataIndex(key, torch.Size(chunk.offsets))]
        if info.transform_descriptors:
            raise NotImplementedError(f"{key}: transformed (e.g. compressed) checkpoint chunks are not supported")
        fd = self._fd(info.relative_path)
        if os.fstat(fd).st_size < info.offset + info.length:
            raise ValueError(f"truncated checkpoint file {self.dir / info.relative_path} (chunk of {key})")
        tensor = read_torch_save_tensor(fd, info.offset, info.length, out=out)
        if tensor is None:
            raw = os.pread(fd, info.length, info.offset)
            if len(raw) != info.length:
                raise ValueError(f"truncated checkpoint file {self.dir / info.relative_path} (chunk of {key})")
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            if out is not None:
                out.copy_(tensor.reshape(out.shape))
                tensor = out
        return tensor

    def read_region(self, key: str, offsets, sizes, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``sizes`` region at ``offsets`` of global tensor ``key`` (written into ``out`` when
        given: a tensor of shape ``sizes``).

        Raises:
            KeyError: unknown key. ValueError: the saved chunks do not cover the region.
        """
        meta = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[key])
        for chunk in meta.chunks:  # fast path: the region is exactly one saved chunk
            if tuple(chunk.offsets) == tuple(offsets) and tuple(chunk.sizes) == tuple(sizes):
                return self._chunk(key, chunk, out)
        if out is None:
            out = torch.empty(tuple(sizes), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + cs) for o, s, c, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= lo_d for lo_d, h in zip(lo, hi)):
                continue
            dst = out
            for dim, (lo_d, h) in enumerate(zip(lo, hi)):
                dst = dst.narrow(dim, lo_d - offsets[dim], h - lo_d)
            if tuple(lo) == tuple(chunk.offsets) and tuple(dst.shape) == tuple(chunk.sizes) and dst.is_contiguous():
                self._chunk(key, chunk, dst)  # a whole chunk into contiguous rows: read in place
            else:
                src = self._chunk(key, chunk)
                for dim, (lo_d, h) in enumerate(zip(lo, hi)):
                    src = src.narrow(dim, lo_d - chunk.offsets[dim], h - lo_d)
                dst.copy_(src)
            covered += dst.numel()
        if covered != out.numel():
            raise ValueError(f"{key}: checkpoint chunks cover {covered} of {out.numel()} elements of "
                             f"region offsets={tuple(offsets)} sizes={tuple(sizes)}")
        return out

    def _read_sharded(self, value, out: torch.Tensor) -> torch.Tensor:
        """Read a ShardedTensor's region into ``out`` (its local shape)."""
        sizes = (1,) * value.prepend_axis_num + tuple(value.local_shape)
        self.read_region(value.key, value.global_offset, sizes, out=out.view(sizes))
        return out

    def _fill_factory(self, factory, allocate, fill):
        """A factory's tensor read in place: its parts (e.g. the gate and up halves of a GLU
        ``linear_fc1``) are views of one buffer, so the merge is that buffer. Falls back to
        Megatron's build / merge when the parts are not disjoint views covering the buffer."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = allocate(tuple(factory.data.shape), factory.data.dtype)
        parts = dataclasses.replace(factory, data=out).build()
        flat = parts if isinstance(parts, list) else [parts]
        ptr, size = out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()
        spans = sorted((p.data.data_ptr(), p.data.data_ptr() + p.data.nbytes) for p in flat
                       if isinstance(p, ShardedTensor) and p.data.is_contiguous()
                       and p.data.untyped_storage().data_ptr() == ptr)
        if (len(spans) == len(flat) and sum(e - b for b, e in spans) == out.nbytes == size
                and all(spans[k][1] <= spans[k + 1][0] for k in range(len(spans) - 1))):
            for p in flat:
                self._read_sharded(p, p.data)
            return out
        return factory.merge_fn(fill(factory.build()))

    def load(self, sharded_state_dict: dict, allocate=None) -> dict:
        """Fill a Megatron sharded state dict (flat dict of ShardedTensor / factories) from the
        checkpoint; returns ``{key: tensor}`` like ``dist_checkpointing.load``.

        Args:
            allocate: ``(shape, dtype) -> tensor`` for the results (e.g. a
                :class:`~megarl.conversion.fastio.StoragePool`'s ``empty``); default ``torch.empty``.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype))

        def fill(value):
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, list):
                return [fill(v) for v in value]
            if isinstance(value, ShardedTensorFactory):
                return self._fill_factory(value, allocate, fill)
            if isinstance(value, ShardedTensor):
                return self._read_sharded(value, allocate(tuple(value.local_shape), value.dtype))
            return value

        return fill(sharded_state_dict)
