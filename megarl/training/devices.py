"""The CUDA device a process uses: the one it was given, read from what it sees.

No torch import at module level: Ray actors report their devices (``TrainerWorker.device_info``)
without paying for it.
"""
from __future__ import annotations

import os
from collections.abc import Sequence


def select_device_index(*, visible_devices: str | None, assigned_gpu_ids: Sequence[str | int],
                        local_rank: int, device_count: int) -> int:
    """The CUDA device index this process uses, from the devices it actually sees.

    Ray gives each trainer actor its GPU(s) and sets ``CUDA_VISIBLE_DEVICES`` to their ids, so the
    process sees them as devices ``0 .. n-1`` in that order; ``LOCAL_RANK`` (the rank's index on its
    node, up to 7) is then no device index. The rule, in order:

    1. Ray assigned GPU ids: the position of the first one in ``CUDA_VISIBLE_DEVICES`` (its own
       index when ``CUDA_VISIBLE_DEVICES`` is unset, as on a node where Ray does not set it);
    2. the process sees exactly one device: ``0``;
    3. otherwise (``torchrun``: every GPU of the node visible): ``local_rank``.

    Args:
        visible_devices: ``CUDA_VISIBLE_DEVICES`` as set (None when unset).
        assigned_gpu_ids: ``ray.get_gpu_ids()`` (empty outside a Ray actor with GPUs).
        local_rank: ``LOCAL_RANK``.
        device_count: ``torch.cuda.device_count()``.

    Raises:
        RuntimeError: the chosen index is not a device this process sees (names the values).
    """
    visible = [d.strip() for d in visible_devices.split(",") if d.strip()] if visible_devices else None
    where = (f"CUDA_VISIBLE_DEVICES={visible_devices!r}, Ray GPU ids {list(assigned_gpu_ids)}, "
             f"LOCAL_RANK={local_rank}, {device_count} visible devices")
    if assigned_gpu_ids:
        first = str(assigned_gpu_ids[0])
        if visible is None:
            index = int(first)
        elif first in visible:
            index = visible.index(first)
        else:
            raise RuntimeError(f"Ray's GPU {first} is not in CUDA_VISIBLE_DEVICES ({where})")
    elif device_count == 1:
        index = 0
    else:
        index = local_rank
    if not 0 <= index < device_count:
        raise RuntimeError(f"device index {index} is not visible to this process ({where})")
    return index


def local_device_index() -> int:
    """:func:`select_device_index` for this process (reads Ray's assignment when inside Ray)."""
    import torch

    gpu_ids: Sequence[str | int] = []
    try:
        import ray

        if ray.is_initialized():
            gpu_ids = ray.get_gpu_ids()
    except ImportError:
        pass
    return select_device_index(visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), assigned_gpu_ids=gpu_ids,
                               local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                               device_count=torch.cuda.device_count())
