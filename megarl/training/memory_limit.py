"""A colocated trainer rank's share of its GPU: enforced on the device, not only declared.

While colocated engines hold their memory (rollout, weight sync) a trainer rank keeps at most
``cluster.colocated_trainer_memory_fraction`` of its GPU; while it trains the engines have released
theirs and it may use the whole GPU (`megarl.cluster.colocated`). Before the engines resume,
:func:`shrink` frees what the step cached (``torch.cuda.empty_cache``: activations, logits and
dispatch buffers are gone, their blocks stay reserved by the caching allocator until released)
and caps the process (``torch.cuda.set_per_process_memory_fraction``: an allocation beyond the
fraction raises out-of-memory in the trainer instead of taking the engines' memory); :func:`lift`
removes the cap once the engines have released theirs.

The device is the one the rank's model lives on (its process group's device,
`megarl.training.devices.local_device_index`), never an index derived from ``LOCAL_RANK``. On a
CPU device both are no-ops.

What does not fit the fraction can leave the GPU while the engines hold theirs
(``cluster.colocated_offload``; ``megarl validate`` / ``megarl plan`` count it as not resident,
`megarl.plan.fit.OFFLOADED`): :func:`offload` before :func:`shrink`, :func:`restore` after
:func:`lift`, with Megatron-Core 0.16.1's own calls: ``optimizer`` = ``MegatronOptimizer.offload_to_cpu``
/ ``restore_from_cpu`` (``megatron/core/optimizer/optimizer.py:344-381``, chained: ``:1414``: the
optimizer's parameters, which are the FP32 main weights under BF16, and its Adam states move to the
host; they only move CUDA tensors, so on CPU nothing moves and ``restore_from_cpu``, which would
move host tensors to CUDA, is not called); ``optimizer_and_grads`` also frees the gradient buffers
(``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``,
``megatron/core/distributed/distributed_data_parallel.py:575-613``: the storage is resized to 0 and
zeroed when restored, which is what the next step's ``zero_grad_buffer`` would do). The model's own
parameters stay: the weight sync and the next step's logprobs read them. Only under mixed precision:
with FP32 the optimizer's parameters are the model's (views of the DDP buffer), and ``megarl
validate`` refuses it.
"""
from __future__ import annotations

import gc
from typing import Any


def _cuda(device: Any) -> Any:
    import torch

    device = torch.device(device)
    return device if device.type == "cuda" else None


def shrink(device: Any, fraction: float) -> dict[str, float]:
    """Release the rank's cached blocks and cap it at ``fraction`` of ``device``'s memory.

    Args:
        device: the rank's device (``torch.device`` or its name); CPU: nothing to do.
        fraction: ``cluster.colocated_trainer_memory_fraction``, in (0, 1].

    Returns:
        ``colocated/trainer_reserved_gb`` (bytes the allocator still holds, GB) and
        ``colocated/trainer_limit_gb`` (the cap, GB); empty on CPU.

    Raises:
        ValueError: ``fraction`` outside (0, 1].
        RuntimeError: after the release the rank still holds more than its fraction (names both
            numbers): the engines would not get their memory back.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"cluster.colocated_trainer_memory_fraction must be in (0, 1], got {fraction}")
    cuda = _cuda(device)
    if cuda is None:
        return {}
    import torch

    gc.collect()  # tensors of the step only referenced from cycles still hold their blocks
    torch.cuda.synchronize(cuda)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(cuda).total_memory
    reserved = torch.cuda.memory_reserved(cuda)
    if reserved > fraction * total:
        raise RuntimeError(f"colocated trainer rank on {cuda} still holds {reserved / 1e9:.2f} GB after releasing its "
                           f"cache, more than cluster.colocated_trainer_memory_fraction={fraction} x "
                           f"{total / 1e9:.1f} GB = {fraction * total / 1e9:.2f} GB")
    torch.cuda.set_per_process_memory_fraction(fraction, cuda)
    return {"colocated/trainer_reserved_gb": reserved / 1e9, "colocated/trainer_limit_gb": fraction * total / 1e9}


def lift(device: Any) -> None:
    """Remove :func:`shrink`'s cap (the engines have released their memory); CPU: nothing to do."""
    cuda = _cuda(device)
    if cuda is None:
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(1.0, cuda)


OFFLOADS = ("none", "optimizer", "optimizer_and_grads")
"""``cluster.colocated_offload``'s values."""


def _check_mode(mode: str) -> None:
    if mode not in OFFLOADS:
        raise ValueError(f"cluster.colocated_offload must be one of {', '.join(OFFLOADS)}, got {mode!r}")


def offload(optimizer: Any, model_chunks: list, mode: str, device: Any) -> None:
    """Move what ``mode`` names off the rank's GPU (module docstring); call before :func:`shrink`.

    Args:
        optimizer: the rank's Megatron optimizer (``offload_to_cpu``).
        model_chunks: its DDP-wrapped model chunks (``offload_grad_buffers``).
        mode: ``cluster.colocated_offload``.
        device: the rank's device; CPU: the gradient buffers are freed, nothing else moves.

    Raises:
        ValueError: ``mode`` is not one of :data:`OFFLOADS`.
    """
    _check_mode(mode)
    if mode == "none":
        return
    cuda = _cuda(device)
    if cuda is not None:
        import torch

        with torch.cuda.device(cuda):
            optimizer.offload_to_cpu()
    if mode == "optimizer_and_grads":
        for chunk in model_chunks:
            chunk.offload_grad_buffers(synchronize=cuda is not None, empty_cache=cuda is not None)


def restore(optimizer: Any, model_chunks: list, mode: str, device: Any) -> None:
    """Bring back what :func:`offload` moved, onto the rank's own device; call after :func:`lift`.

    Raises:
        ValueError: ``mode`` is not one of :data:`OFFLOADS`.
    """
    _check_mode(mode)
    if mode == "none":
        return
    cuda = _cuda(device)
    if mode == "optimizer_and_grads":
        for chunk in model_chunks:
            chunk.restore_grad_buffers(synchronize=cuda is not None)
    if cuda is not None:
        import torch

        with torch.cuda.device(cuda):  # .cuda() in Megatron's restore: the current device
            optimizer.restore_from_cpu()
