"""The binary payloads exchanged with an SGLang server: routed-expert ids out of ``/generate``, named
tensors into ``/update_weights_from_tensor`` (CPU shared memory or CUDA IPC keyed by device UUID)."""
from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
import torch


def decode_routed_experts(data: str, num_layers: int, topk: int) -> torch.Tensor:
    """Decode SGLang's ``meta_info["routed_experts"]``.

    Args:
        data: base64 of little-endian int32, row-major ``[rows, num_layers, topk]``.
        num_layers: decoder layers L (``num_hidden_layers`` of the HF config).
        topk: experts per token K (``num_experts_per_tok``).

    Returns:
        ``[rows, L, K]`` int32 Hugging Face expert ids. With ``routed_experts_start_len=0`` rows is
        ``P + N - 1``: every prompt token and every output token but the last sampled one.

    Raises:
        ValueError: the payload size is not a multiple of ``L * K`` int32 values.
    """
    raw = base64.b64decode(data)
    row_bytes = 4 * num_layers * topk
    if len(raw) % row_bytes:
        raise ValueError(f"routed_experts payload of {len(raw)} bytes is not a multiple of "
                         f"4 * num_layers({num_layers}) * topk({topk})")
    flat = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))
    return flat.view(-1, num_layers, topk)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One rank's ``update_weights_from_tensor`` payload: base64 of a torch ForkingPickler dump.

    CPU tensors are shared with the server through named shared-memory files (torch's
    ``file_system`` strategy, set process-wide here): the default file-descriptor strategy needs a
    multiprocessing connection the server does not have. CUDA tensors travel as CUDA IPC handles
    keyed by their device's UUID (:func:`device_uuid_args`): the server's ranks see other
    ``CUDA_VISIBLE_DEVICES`` than this process, so a device index would name another GPU there.
    Keep the tensors alive until the update request has returned.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    if any(t.device.type == "cpu" for _, t in named_tensors):
        tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if any(t.is_cuda for _, t in named_tensors):
        pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_tensor_by_uuid,
                                  torch.nn.Parameter: _reduce_tensor_by_uuid}
    pickler.dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")


REBUILD_CUDA_DEVICE_ARG = 6
"""Position of ``storage_device`` in ``torch.multiprocessing.reductions.rebuild_cuda_tensor``'s
arguments (the index SGLang's ``sglang.srt.utils.patch_torch`` rewrites too)."""


def device_uuid_args(args: tuple, uuid_of) -> tuple:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by ``uuid_of(index)``.

    SGLang's server rebuilds such a tensor on the local device with that UUID (it patches
    ``rebuild_cuda_tensor`` before reading ``update_weights_from_tensor`` payloads). A UUID already
    there (a sender that applied SGLang's patch itself) is kept.
    """
    device = args[REBUILD_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        return args
    return args[:REBUILD_CUDA_DEVICE_ARG] + (uuid_of(device),) + args[REBUILD_CUDA_DEVICE_ARG + 1:]


def _reduce_tensor_by_uuid(tensor: torch.Tensor):
    """torch's ForkingPickler reducer, CUDA storages named by device UUID (:func:`device_uuid_args`)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = device_uuid_args(args, lambda index: str(torch.cuda.get_device_properties(index).uuid))
    return rebuild, args
