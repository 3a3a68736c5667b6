"""Streaming safetensors I/O for Hugging Face checkpoint directories.

Reading: :class:`HFCheckpointReader` reads one tensor at a time with positioned reads (no mmap, so
the process's resident memory holds only the tensors being converted). Shards are checked up front:
a shard named by the index but absent, or shorter than its header declares, is an error that names
the file. Writing: :class:`SafetensorsStreamWriter` writes the header first (names, dtypes, shapes
planned in advance) and then each tensor as it is produced, so a shard is never held in memory.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Sequence

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFileError(ValueError):
    """A missing, truncated or malformed checkpoint file (the message names the file)."""


def _read_header(path: Path) -> tuple[dict, int]:
    """The header dict and the byte offset where tensor data starts."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointFileError(f"missing checkpoint shard: {path}") from None
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFileError(f"truncated checkpoint shard {path}: {size} bytes, no header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise CheckpointFileError(f"truncated checkpoint shard {path}: header of {header_len} bytes "
                                      f"but the file has {size} bytes")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if data_start + data_end > size:
        raise CheckpointFileError(
            f"truncated checkpoint shard {path}: the header declares {data_start + data_end} bytes "
            f"but the file has {size} bytes")
    return header, data_start


class HFCheckpointReader:
    """Tensor-by-tensor reader of an HF directory's safetensors (single file or indexed shards).

    Raises (at construction):
        CheckpointFileError: no weights, a missing shard, or a truncated shard.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.hf_dir / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            raise CheckpointFileError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.hf_dir}")
        self._entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.hf_dir / name
            header, start = _read_header(path)
            for key, meta in header.items():
                self._entries[key] = (path, meta, start)
        if index.exists():
            missing = sorted(k for k in weight_map if k not in self._entries)
            if missing:
                raise CheckpointFileError(f"{index} lists {len(missing)} tensors absent from their "
                                          f"shards, e.g. {missing[:3]}")

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without reading it."""
        return tuple(self._lookup(name)[1]["shape"])

    def nbytes(self, name: str) -> int:
        """Size of a tensor's data in bytes."""
        begin, end = self._lookup(name)[1]["data_offsets"]
        return end - begin

    def _lookup(self, name: str):
        if name not in self._entries:
            raise KeyError(f"tensor {name!r} not found in the safetensors of {self.hf_dir}")
        return self._entries[name]

    def location(self, name: str) -> tuple[Path, int, torch.dtype, tuple[int, ...]]:
        """``(file, byte offset of the data, dtype, shape)`` of a tensor.

        Raises:
            KeyError: no such tensor.
        """
        path, meta, start = self._lookup(name)
        return path, start + meta["data_offsets"][0], _DTYPES[meta["dtype"]], tuple(meta["shape"])

    def fd(self, path: Path) -> int:
        """A read-only descriptor of one of the shards, opened once (closed by :meth:`close`)."""
        fds = self.__dict__.setdefault("_fds", {})
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    def close(self) -> None:
        """Close the descriptors :meth:`fd` opened."""
        for fd in self.__dict__.pop("_fds", {}).values():
            os.close(fd)

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor owning its memory).

        Raises:
            KeyError: no such tensor. CheckpointFileError: the read came up short.
        """
        path, meta, start = self._lookup(name)
        begin, end = meta["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        out = torch.empty(meta["shape"], dtype=dtype)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")
        with open(path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view], start + begin) if end > begin else 0
        if got != end - begin:
            raise CheckpointFileError(f"short read of {name!r} from {path}: {got} of {end - begin} bytes")
        return out


def _header_bytes(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, list[int]]:
    header, sizes, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        sizes.append(nbytes)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors arrive one at a time in a planned order.

    Args:
        path: output file.
        entries: ``(name, dtype, shape)`` of every tensor, in the order they will be written.

    Raises (from :meth:`write` / :meth:`close`):
        ValueError: a tensor out of order or with another dtype/shape than planned, or missing at close.
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, Sequence[int]]]):
        self.entries = [(n, d, tuple(s)) for n, d, s in entries]
        header, self._sizes = _header_bytes(self.entries)
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._file.write(header)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor."""
        want_name, dtype, shape = self.entries[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, dtype, shape):
            raise ValueError(f"{self.path}: expected {want_name} {dtype} {shape}, got {name} "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy() if tensor.numel() else b""
        self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        """Finish the file."""
        self._file.close()
        if self._next != len(self.entries):
            raise ValueError(f"{self.path}: {len(self.entries) - self._next} planned tensors were not "
                             f"written (next: {self.entries[self._next][0]})")


def plan_shards(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                max_shard_bytes: int) -> list[list[tuple[str, torch.dtype, tuple]]]:
    """Split planned tensors into consecutive shards of at most ``max_shard_bytes`` (a single
    larger tensor gets its own shard)."""
    shards, current, size = [], [], 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, dtype, tuple(shape)))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """HF's shard names: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_index(out_dir: Path, shards: Sequence[Sequence[tuple]], files: Sequence[str]) -> None:
    """Write ``model.safetensors.index.json`` (only for more than one shard, as HF does)."""
    if len(files) < 2:
        return
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                for shard in shards for _, d, s in shard)
    weight_map = {name: file for shard, file in zip(shards, files) for name, _, _ in shard}
    (out_dir / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
