"""The one rule for collectives in megarl: a collective's tensors live on its group's device.

A process group supports the device types of its backends: ``gloo`` CPU (and CUDA), ``nccl`` CUDA
only, a ``cpu:gloo,cuda:nccl`` group both. Call sites do not pick a device themselves and do not
call ``torch.distributed``'s collectives directly (``tests/unit/training/test_collectives.py``
scans the package for that): they call the wrappers here (:func:`all_reduce`, :func:`broadcast`,
:func:`send` / :func:`recv`, :func:`isend` / :func:`irecv`, :func:`all_gather`, :func:`barrier`,
the object collectives), which move a tensor the group cannot take to the group's device (CUDA:
this process's current device, see :func:`megarl.training.devices.local_device_index`) and hand
the result back on the caller's device; a new buffer for a group is allocated on
:func:`group_device`. Control-plane hand-offs (barriers, turn tokens) go over a gloo group instead
(:func:`control_group`): under NCCL a ``recv`` returns before the host has the token.

Every wrapper takes the group's ranks exactly as ``torch.distributed`` does (``src`` / ``dst`` are
global ranks; for a group built outside the default group, e.g. SGLang's weight-update group, its
own ranks) and runs on ``group`` (default: the default group).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def collective_device(tensor_device: torch.device, supported: Sequence[str], *,
                      cuda_index: int | None = None) -> torch.device:
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


def group_devices(group: dist.ProcessGroup | None = None) -> list[str]:
    """Device types ``group`` (default: the default group) supports, from its backends."""
    return dist.distributed_c10d._device_capability(group)


def current_cuda_index(supported: Sequence[str]) -> int | None:
    """This process's CUDA device when a group supporting ``supported`` may need it, else None."""
    return torch.cuda.current_device() if "cuda" in supported and torch.cuda.is_available() else None


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a new tensor for a collective on ``group`` is allocated.

    The CPU when the group runs there (gloo, ``cpu:gloo,cuda:nccl``): control-plane tensors stay
    on the host; else (nccl) this process's CUDA device.
    """
    supported = group_devices(group)
    if "cpu" in supported:
        return torch.device("cpu")
    return collective_device(torch.device("cpu"), supported, cuda_index=current_cuda_index(supported))


def on_group_device(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` itself when ``group`` can run a collective on it, else a copy on the group's device."""
    supported = group_devices(group)
    device = collective_device(tensor.device, supported, cuda_index=current_cuda_index(supported))
    return tensor if device == tensor.device else _move(tensor, device)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The copy of ``tensor`` on ``device`` a collective runs on (one place, so tests can stand in for CUDA)."""
    return tensor.to(device)


class MovedWork:
    """Handle of an asynchronous collective that ran on a copy of the caller's tensor on the
    group's device; :meth:`wait` copies the result back into the caller's tensor (receivers)."""

    def __init__(self, work, moved: torch.Tensor, original: torch.Tensor, copy_back: bool) -> None:
        self._work, self._moved, self._original, self._copy_back = work, moved, original, copy_back

    def is_completed(self) -> bool:
        """The collective finished (the result is not yet copied back: :meth:`wait` does that)."""
        return self._work.is_completed()

    def wait(self, timeout=None) -> bool:
        """Wait for the collective (up to ``timeout``, a ``datetime.timedelta``, when given), then copy
        the result into the caller's tensor once (receivers). Returns True.
        """
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        if self._copy_back:
            self._original.copy_(self._moved)
            self._copy_back = False
        return True


def _run(tensor: torch.Tensor, group, call, *, returns_handle: bool, copy_back: bool):
    """``call(t)`` with ``t`` = ``tensor`` on the group's device (see module docstring).

    Args:
        call: runs the collective on its argument; returns its handle or None.
        returns_handle: the collective is asynchronous: return its handle (a :class:`MovedWork`
            when ``tensor`` moved), else return None once done.
        copy_back: ``tensor`` receives data: copy a moved result back into it.
    """
    work_tensor = on_group_device(tensor, group)
    handle = call(work_tensor)
    moved = work_tensor is not tensor
    if returns_handle:
        return MovedWork(handle, work_tensor, tensor, copy_back) if moved and handle is not None else handle
    if moved and copy_back:
        tensor.copy_(work_tensor)
    return None


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, *, async_op: bool = False):
    """All-reduce ``tensor`` over ``group`` in place on the group's device.

    Returns:
        ``tensor`` (on its own device, reduced); with ``async_op`` the collective's handle
        (``wait()`` it before reading ``tensor``).
    """
    handle = _run(tensor, group, lambda t: dist.all_reduce(t, op=op, group=group, async_op=async_op),
                  returns_handle=async_op, copy_back=True)
    return handle if async_op else tensor


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *,
              async_op: bool = False):
    """Broadcast ``tensor`` from rank ``src`` over ``group``; receivers get the result in ``tensor``.

    Returns:
        None, or with ``async_op`` the handle (``wait()`` it before reading or reusing ``tensor``).
    """
    return _run(tensor, group, lambda t: dist.broadcast(t, src=src, group=group, async_op=async_op),
                returns_handle=async_op, copy_back=True)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, *, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst`` over ``group`` (blocking)."""
    _run(tensor, group, lambda t: dist.send(t, dst, group=group, tag=tag), returns_handle=False, copy_back=False)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *, tag: int = 0) -> None:
    """Receive into ``tensor`` from rank ``src`` over ``group`` (blocking)."""
    _run(tensor, group, lambda t: dist.recv(t, src, group=group, tag=tag), returns_handle=False, copy_back=True)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, *, tag: int = 0):
    """Start sending ``tensor`` to rank ``dst``; returns the handle (``tensor`` must stay unchanged until
    ``wait()``)."""
    return _run(tensor, group, lambda t: dist.isend(t, dst, group=group, tag=tag), returns_handle=True,
                copy_back=False)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *, tag: int = 0):
    """Start receiving into ``tensor`` from rank ``src``; returns the handle (``tensor`` holds the data after
    ``wait()``)."""
    return _run(tensor, group, lambda t: dist.irecv(t, src, group=group, tag=tag), returns_handle=True,
                copy_back=True)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on every rank), in group rank order.

    Returns:
        ``world_size`` tensors shaped like ``tensor``, on ``tensor``'s device.
    """
    work_tensor = on_group_device(tensor.contiguous(), group)
    parts = [torch.empty_like(work_tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, work_tensor, group=group)
    return [p.to(tensor.device) for p in parts]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` reached this point (use a :func:`control_group` to
    block the host under NCCL)."""
    dist.barrier(group=group)


def broadcast_object_list(objects: list, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Broadcast picklable ``objects`` (in place) from ``src``; torch serialises them onto the
    group's device itself (``_get_object_coll_device``: CPU where the group has it, else the
    current CUDA device)."""
    dist.broadcast_object_list(objects, src=src, group=group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable ``obj``, in group rank order (device chosen by torch, as
    :func:`broadcast_object_list`)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def control_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of ``group`` for host-synchronised hand-offs (collective).

    Returns ``group`` itself when it already runs on the CPU; otherwise a new gloo group, so every
    rank of the default group must call this, in the same order (``dist.new_group`` is collective).
    """
    if "cpu" in group_devices(group):
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")
