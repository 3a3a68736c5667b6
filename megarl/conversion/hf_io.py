"""Streaming safetensors I/O for Hugging Face checkpoint directories.

Reading: :class:`HFCheckpointReader` reads one tensor at a time with positioned reads (no mmap, so
the process's resident memory holds only the tensors being converted). Shards are checked up front:
a shard named by the index but absent, or shorter than its header declares, is an error that names
the file. ``name[E]`` reads row E of a tensor stacking every expert of a layer (gpt-oss's
``mlp.experts.gate_up_proj``), that row's bytes only.

Block-FP8 checkpoints (DeepSeek-V3's and Qwen3's FP8 releases: ``config.json`` has a block-wise
``quantization_config``, quantised linears are ``float8_e4m3fn`` with a float32
``<name>_scale_inv``) read as the unquantised checkpoint they stand for: :meth:`HFCheckpointReader.get`
of an FP8 weight reads it and its scales and returns ``q * scale_inv`` per block in the config's
``torch_dtype`` (:mod:`megarl.models.fp8_blocks`), one tensor at a time, stripe by stripe, so
conversion and ``model.hf_path`` loading stream through the model as for a BF16 checkpoint; the
``_scale_inv`` tensors are not listed by :meth:`~HFCheckpointReader.keys`. Writing: :class:`SafetensorsStreamWriter`
writes the header first (names, dtypes, shapes
planned in advance) and then each tensor as it is produced, so a shard is never held in memory.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFileError(UserError):
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
        CheckpointFileError: no weights, a missing shard, a truncated shard, or FP8 weights whose
            ``_scale_inv`` is missing, misshapen, or not announced by a ``quantization_config``.
        ValueError: a ``quantization_config`` other than block-wise e4m3 FP8 (names the field).
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
        self.quantization, self.dequantized_dtype = _block_fp8_settings(self.hf_dir)
        self._scales = self._find_scales()
        """FP8 weight name -> its ``_scale_inv`` tensor name (empty for an unquantised checkpoint)."""

    def _find_scales(self) -> dict[str, str]:
        from megarl.models.fp8_blocks import scale_name

        fp8 = [k for k, (_, meta, _) in self._entries.items() if meta["dtype"] == "F8_E4M3"]
        if fp8 and self.quantization is None:
            raise CheckpointFileError(f"{self.hf_dir}: {len(fp8)} float8_e4m3fn tensors (e.g. {fp8[0]}) but "
                                      f"config.json has no block-wise FP8 quantization_config")
        scales = {}
        for name in fp8:
            scale = scale_name(name)
            if scale not in self._entries:
                raise CheckpointFileError(f"{self.hf_dir}: FP8 weight {name} has no {scale}")
            want = self.quantization.scale_shape(self._entries[name][1]["shape"])
            if tuple(self._entries[scale][1]["shape"]) != want:
                raise CheckpointFileError(f"{self.hf_dir}: {scale} has shape "
                                          f"{tuple(self._entries[scale][1]['shape'])}, "
                                          f"expected {want} for {name} with blocks {self.quantization.block}")
            scales[name] = scale
        return scales

    def keys(self) -> list[str]:
        """All tensor names (of a block-FP8 checkpoint: without the ``_scale_inv`` tensors)."""
        hidden = set(self._scales.values())
        return [k for k in self._entries if k not in hidden]

    def __contains__(self, name: str) -> bool:
        try:
            self._lookup(name)
        except KeyError:
            return False
        return name not in self._scales.values()

    def dequantizes(self, name: str) -> bool:
        """True when :meth:`get` returns ``name`` dequantised from stored FP8 (see module docstring)."""
        return name in self._scales

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without reading it."""
        return tuple(self._lookup(name)[1]["shape"])

    def nbytes(self, name: str) -> int:
        """Size of a tensor's stored data in bytes."""
        begin, end = self._lookup(name)[1]["data_offsets"]
        return end - begin

    def _lookup(self, name: str):
        """``(file, header entry, data start)``; for ``name[E]`` (an expert's slice of a stacked
        tensor, ``megarl.models.table.Entry``) a header entry describing row E of that tensor."""
        if name in self._entries:
            return self._entries[name]
        from megarl.models.mapping import expert_slice

        base, expert = expert_slice(name)
        if expert is None or base not in self._entries or base in self._scales:
            raise KeyError(f"tensor {name!r} not found in the safetensors of {self.hf_dir}")
        path, meta, start = self._entries[base]
        shape = meta["shape"]
        if not shape or expert >= shape[0]:
            raise KeyError(f"tensor {name!r}: {base} has shape {tuple(shape)} in {self.hf_dir}")
        begin, end = meta["data_offsets"]
        row = (end - begin) // shape[0]
        return path, dict(meta, shape=shape[1:], data_offsets=[begin + expert * row, begin + (expert + 1) * row]), start

    def location(self, name: str) -> tuple[Path, int, torch.dtype, tuple[int, ...]]:
        """``(file, byte offset of the data, dtype, shape)`` of a tensor as stored (an FP8 weight that
        :meth:`get` dequantises: its FP8 bytes; see :meth:`dequantizes`).

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
        """Read one tensor (a fresh CPU tensor owning its memory); an FP8 weight of a block-FP8
        checkpoint comes dequantised, in :attr:`dequantized_dtype`.

        Raises:
            KeyError: no such tensor. CheckpointFileError: the read came up short.
        """
        if name in self._scales:
            from megarl.models.fp8_blocks import dequantize_blockwise

            return dequantize_blockwise(self._read(name), self._read(self._scales[name]), self.quantization.block,
                                        dtype=self.dequantized_dtype)
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        path, meta, start = self._lookup(name)
        begin, end = meta["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        out = torch.empty(meta["shape"], dtype=dtype)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")  # type: ignore[arg-type]  # ndarray: a buffer
        with open(path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view], start + begin) if end > begin else 0
        if got != end - begin:
            raise CheckpointFileError(f"short read of {name!r} from {path}: {got} of {end - begin} bytes")
        return out


def _block_fp8_settings(hf_dir: Path):
    """``(BlockFP8 or None, dtype to dequantise to)`` from ``hf_dir/config.json`` (no config: None)."""
    from megarl.models.fp8_blocks import parse_quantization_config

    config_file = hf_dir / "config.json"
    if not config_file.exists():
        return None, torch.bfloat16
    config = json.loads(config_file.read_text())
    quantization = parse_quantization_config(config.get("quantization_config"),
                                             where=f"{config_file}: quantization_config")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return quantization, getattr(torch, dtype.removeprefix("torch."), torch.bfloat16)


def _header_bytes(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, list[int]]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    sizes, offset = list[int](), 0
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
        self._file.write(memoryview(data))  # type: ignore[arg-type]  # ndarray: a buffer
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
    shards, current, size = [], list[tuple[str, torch.dtype, tuple]](), 0
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
