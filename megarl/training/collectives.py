"""The one rule for collectives in megarl: a collective's tensors live on its group's device.

A process group supports the device types of its backends: ``gloo`` CPU (and CUDA), ``nccl`` CUDA
only, a ``cpu:gloo,cuda:nccl`` group both. Call sites do not pick a device themselves; they call
:func:`all_reduce` / :func:`on_group_device` here, which move a tensor the group cannot take to the
group's device (CUDA: this process's current device, see
:func:`megarl.training.devices.local_device_index`) and hand the result back on the caller's
device. Control-plane hand-offs (barriers, turn tokens) go over a gloo group instead
(:func:`control_group`): under NCCL a ``recv`` returns before the host has the token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def collective_device(tensor_device: torch.device, supported: Sequence[str], *,
                      cuda_index: Optional[int] = None) -> torch.device:
    """Where a tensor on ``tensor_device`` must be for a collective on a group supporting ``supported``.

    Args:
        tensor_device: the tensor's device.
        supported: the group's device types (``["cpu", "cuda"]`` for gloo, ``["cuda"]`` for nccl).
        cuda_index: this process's CUDA device (used when the tensor must move to CUDA).

    Returns:
        ``tensor_device`` when the group supports it, else the group's first device type.

    Raises:
        ValueError: ``supported`` is empty.
    """
    if not supported:
        raise ValueError("the process group supports no device type")
    if tensor_device.type in supported:
        return tensor_device
    if supported[0] == "cuda":
        return torch.device("cuda", 0 if cuda_index is None else cuda_index)
    return torch.device(supported[0])


def group_devices(group: Optional[dist.ProcessGroup] = None) -> list[str]:
    """Device types ``group`` (default: the default group) supports, from its backends."""
    return dist.distributed_c10d._device_capability(group)


def on_group_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``tensor`` itself when ``group`` can run a collective on it, else a copy on the group's device."""
    supported = group_devices(group)
    cuda_index = torch.cuda.current_device() if "cuda" in supported and torch.cuda.is_available() else None
    return tensor.to(collective_device(tensor.device, supported, cuda_index=cuda_index))


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-reduce ``tensor`` over ``group`` in place and return it (on its own device).

    The reduction runs on the group's device (:func:`on_group_device`); a moved tensor's result
    is copied back into ``tensor``.
    """
    work = on_group_device(tensor, group)
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def control_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group over the ranks of ``group`` for host-synchronised hand-offs (collective).

    Returns ``group`` itself when it already runs on the CPU; otherwise a new gloo group, so every
    rank of the default group must call this, in the same order (``dist.new_group`` is collective).
    """
    if "cpu" in group_devices(group):
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")
