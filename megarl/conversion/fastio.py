"""Copy-avoiding paths of the directory converters (``megarl.conversion.groups``).

The converters move every byte of a model through two files; what costs time besides the reads and
writes themselves is touching fresh memory (every new CPU tensor's pages fault in; on a VM that is
~1 s per GB) and the intermediate copies (HF tensor -> ``torch.cat`` -> parameter; checkpoint
bytes -> ``bytes`` -> ``torch.load`` storage). This module removes both:

* :class:`StoragePool`: the CPU storages of one group (one layer) are handed to the next group of
  the same shapes, so pages fault in once per conversion, not once per layer.
* :func:`read_hf_into`: reads the HF tensors of one parameter straight into that parameter's
  rows with ``preadv`` (the q/k/v interleaving, gate/up fusion, vocabulary padding and
  column-parallel splits are row permutations; the plan is traced once per parameter shape by
  running the family's own :func:`~megarl.models.mapping.to_megatron` and
  :func:`~megarl.models.mapping.split_tp` on row-index tensors).
* :func:`read_torch_save_tensor`: reads one ``torch.save`` blob of a dist checkpoint file (the
  format torch.distributed.checkpoint writes per tensor) straight into a tensor, parsing the zip
  headers and the pickle's tensor description instead of going through ``torch.load``.

Every fast path returns ``None`` (or ``False``) when its preconditions do not hold, and the caller
falls back to the general path.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import struct
from collections.abc import Sequence

import torch

_IOV_MAX = 1024


class StoragePool:
    """CPU tensors whose storages are reused from one group of parameters to the next.

    :meth:`empty` hands out a contiguous tensor with its own exactly-sized storage (so that
    torch.distributed.checkpoint saves it without a clone), reusing a released storage of the
    same byte size when there is one. :meth:`release` returns a group's storages; storages that
    stayed free from one release to the next are dropped, so about two groups' storages stay
    alive (the one being filled and the one being written).
    """

    def __init__(self):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[object, list[tuple[int, torch.Tensor]]] = {}

    def empty(self, shape: Sequence[int], dtype: torch.dtype, group: object = None) -> torch.Tensor:
        """An uninitialised contiguous ``shape`` tensor of ``dtype``, lent to ``group``."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if not nbytes:
            return torch.empty(tuple(shape), dtype=dtype)
        free = self._free.get(nbytes) or self._idle.get(nbytes)
        buf = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8)
        self._lent.setdefault(group, []).append((nbytes, buf))
        return buf.view(dtype).view(tuple(shape))

    def release(self, group: object = None) -> None:
        """The group's tensors are no longer used: their storages may be handed out again."""
        self._idle, self._free = self._free, {}
        for nbytes, buf in self._lent.pop(group, []):
            self._free.setdefault(nbytes, []).append(buf)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(tuple(shape)):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)
def row_plan(entry, layout, hf_rows: tuple[int, ...], rank: int, size: int) -> tuple | None:
    """Where each row of a parameter's local shard comes from.

    Args:
        entry: the parameter's mapping :class:`~megarl.models.mapping.Entry`.
        layout: the :class:`~megarl.models.mapping.ModelLayout` (vocabulary padded as the
            parameter is).
        hf_rows: the first dimension of each HF tensor, in ``entry.hf`` order.
        rank, size: the (expert) tensor-parallel rank and size.

    Returns:
        ``(local_rows, runs)`` with ``runs`` a tuple of ``(hf_index, src_row, dst_row, rows)``
        (rows absent from every run are zero padding), or ``None`` when the conversion is not a
        pure row selection (a row-parallel split over more than one rank).
    """
    from megarl.models.mapping import TPSplit, split_tp, to_megatron

    if (entry.tp_split is TPSplit.ROW and size > 1) or entry.transform.value in ("transpose", "glu_interleaved_t"):
        return None
    starts, total = [], 1  # row ids start at 1: 0 marks padding
    for rows in hf_rows:
        starts.append(total)
        total += rows
    index = [torch.arange(s, s + r, dtype=torch.int64).view(r, 1) for s, r in zip(starts, hf_rows)]
    local = split_tp(to_megatron(entry, index, layout), entry.tp_split, rank, size, layout)
    if local.dim() != 2 or local.shape[1] != 1:
        return None
    src = local[:, 0].contiguous()
    if src.numel() == 0:
        return 0, ()
    tensor = torch.searchsorted(torch.tensor(starts), src, right=True) - 1  # -1: padding
    breaks = torch.nonzero((src[1:] != src[:-1] + 1) | (tensor[1:] != tensor[:-1]) | (src[1:] == 0)).flatten() + 1
    firsts = [0, *breaks.tolist()]
    ends = [*firsts[1:], src.numel()]
    runs = []
    for dst, end, t, first in zip(firsts, ends, tensor[firsts].tolist(), src[firsts].tolist()):
        if t >= 0:
            runs.append((t, first - starts[t], dst, end - dst))
    return local.shape[0], tuple(runs)


def _preadv_all(fd: int, views: list, offset: int) -> int:
    done = 0
    for k in range(0, len(views), _IOV_MAX):
        batch = views[k: k + _IOV_MAX]
        want = sum(len(v) for v in batch)
        got = os.preadv(fd, batch, offset + done)
        while got < want:  # a short read: continue where it stopped (EOF gives 0)
            rest, skip = [], got
            for v in batch:
                if skip >= len(v):
                    skip -= len(v)
                    continue
                rest.append(v[skip:])
                skip = 0
            more = os.preadv(fd, rest, offset + done + got)
            if more <= 0:
                return done + got
            got += more
        done += got
    return done


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    if not tensor.numel():
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray: a buffer


def read_hf_into(param: torch.Tensor, reader, names: Sequence[str], entry, layout, rank: int, size: int) -> bool:
    """Fill ``param`` (contiguous CPU) with its shard of the HF tensors ``names`` without
    intermediate tensors. Returns False (``param`` untouched) when the fast path does not apply:
    a dtype or trailing-shape mismatch, a stored FP8 weight, or a conversion that is not a row selection.

    Raises:
        CheckpointFileError: a short read (names the tensor and file).
    """
    from megarl.conversion.hf_io import CheckpointFileError

    if not param.is_contiguous() or param.dim() == 0:
        return False
    if any(reader.dequantizes(n) for n in names):  # stored FP8: only reader.get dequantises
        return False
    specs = [reader.location(n) for n in names]
    tail = tuple(param.shape[1:])
    if any(dtype != param.dtype or tuple(shape[1:]) != tail or not shape for _, _, dtype, shape in specs):
        return False
    plan = row_plan(entry, layout, tuple(shape[0] for _, _, _, shape in specs), rank, size)
    if plan is None or plan[0] != param.shape[0]:
        return False
    local_rows, runs = plan
    row_bytes = param[0].numel() * param.element_size()
    data = _bytes_view(param)
    covered = torch.zeros(local_rows, dtype=torch.bool)
    for i, (path, offset, _, _) in enumerate(specs):
        mine = sorted((src, dst, n) for k, src, dst, n in runs if k == i)
        fd = reader.fd(path)
        k = 0
        while k < len(mine):  # one preadv per stretch of consecutive source rows
            src0, views, src = mine[k][0], [], mine[k][0]
            while k < len(mine) and mine[k][0] == src:
                _, dst, n = mine[k]
                views.append(data[dst * row_bytes:(dst + n) * row_bytes])
                covered[dst:dst + n] = True
                src += n
                k += 1
            want = (src - src0) * row_bytes
            if _preadv_all(fd, views, offset + src0 * row_bytes) != want:
                raise CheckpointFileError(f"short read of {names[i]!r} from {path}")
    if not bool(covered.all()):
        param[~covered] = 0
    return True


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


class _TensorDescription(pickle.Unpickler):
    """Unpickles a ``torch.save``'d single tensor into its description, loading no data."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid):
        return pid


class _FileSlice(io.RawIOBase):
    """``[offset, offset + length)`` of a file descriptor as a seekable read-only file (positioned
    reads: the descriptor's own offset is not used)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        self._pos = {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence]
        return self._pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, n, self._offset + self._pos) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _zip_records(blob: _FileSlice, head: bytes) -> dict[str, tuple[int, int]] | None:
    """``{name: (data start, size)}`` of the records of a zip, all stored (uncompressed), or None."""
    import zipfile

    try:
        infos = zipfile.ZipFile(blob).infolist()
    except (zipfile.BadZipFile, ValueError, KeyError):
        return None
    records = {}
    for info in infos:
        pos = info.header_offset
        if info.compress_type != zipfile.ZIP_STORED:
            return None
        if pos + _LOCAL_HEADER.size <= len(head):
            fields = _LOCAL_HEADER.unpack_from(head, pos)
        else:
            fields = _LOCAL_HEADER.unpack(os.pread(blob._fd, _LOCAL_HEADER.size, blob._offset + pos))
        if fields[0] != 0x04034B50:
            return None
        records[info.filename] = (pos + _LOCAL_HEADER.size + fields[9] + fields[10], info.file_size)
    return records


def read_torch_save_tensor(fd: int, offset: int, length: int, out: torch.Tensor | None = None,
                           head_bytes: int = 4096) -> torch.Tensor | None:
    """The tensor ``torch.save`` wrote at ``[offset, offset + length)`` of a file, read with one
    ``preadv`` into ``out`` (or a new tensor), or ``None`` when the blob is not a plain contiguous
    little-endian single tensor (the caller then uses ``torch.load``)."""
    head = os.pread(fd, min(head_bytes, length), offset)
    records = _zip_records(_FileSlice(fd, offset, length), head)
    if records is None:
        return None
    pkl = next((k for k in records if k.endswith("/data.pkl")), None)
    order = next((k for k in records if k.endswith("/byteorder")), None)
    if pkl is None or records[pkl][0] + records[pkl][1] > len(head):
        return None
    if order is not None and head[records[order][0]: records[order][0] + records[order][1]] != b"little":
        return None
    try:
        pid, storage_offset, shape, stride = _TensorDescription(
            io.BytesIO(head[records[pkl][0]: records[pkl][0] + records[pkl][1]])).load()
        _, dtype, key, _, numel = pid
    except Exception:  # noqa: BLE001 - anything unexpected: the general path decides
        return None
    data = next((v for k, v in records.items() if k.endswith(f"/data/{key}")), None)
    contiguous = _contiguous_strides(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if (data is None or data[1] != nbytes or storage_offset != 0 or torch.Size(shape).numel() != numel
            or (numel > 1 and tuple(stride) != tuple(contiguous)) or data[0] + nbytes > length):
        return None
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        return None
    if nbytes and _preadv_all(fd, [_bytes_view(out)], offset + data[0]) != nbytes:
        raise ValueError(f"short read of a checkpoint tensor at offset {offset} ({nbytes} bytes)")
    return out
