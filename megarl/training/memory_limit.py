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
CPU device both are no-ops. Offloading parameters, gradients or optimizer state when they do not
fit the fraction is not done: ``megarl validate`` refuses such a layout instead
(`megarl.plan.fit`).
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
