"""A colocated trainer rank's cap on a real GPU (issue 35 item 1; ``@pytest.mark.gpu``, skipped without CUDA).

What the engines get back is what the trainer releases: after a step's tensors are freed the caching
allocator still holds their blocks until `megarl.training.memory_limit.shrink` releases them, and
its cap then makes the trainer fail an allocation beyond its fraction instead of taking the
engines' memory; `lift` removes the cap for the next step. On the device the device rule picks
(`megarl.training.devices.local_device_index`), in a child process so the cap dies with it.
"""
import pytest
import torch

from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def _cap_worker(rank, world_size):
    from megarl.training import memory_limit
    from megarl.training.devices import local_device_index

    device = torch.device("cuda", local_device_index())
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    step = torch.empty(int(0.3 * total), dtype=torch.uint8, device=device)  # a step's activations
    del step
    out = {"cached_before": torch.cuda.memory_reserved(device), "total": total}
    out.update(memory_limit.shrink(device, 0.2))
    out["cached_after"] = torch.cuda.memory_reserved(device)
    try:
        torch.empty(int(0.25 * total), dtype=torch.uint8, device=device)
        out["capped_alloc"] = "ok"
    except torch.cuda.OutOfMemoryError:
        out["capped_alloc"] = "oom"
    memory_limit.lift(device)
    big = torch.empty(int(0.25 * total), dtype=torch.uint8, device=device)
    out["lifted_alloc"] = big.numel()
    return out


@pytest.mark.timeout(240)
def test_shrink_releases_the_cache_and_caps_the_rank_lift_uncaps_it():
    out, = run_ranks(_cap_worker, 1, backend=None, timeout_s=200, start_method="spawn")
    total = out["total"]
    assert out["cached_before"] >= 0.3 * total  # freed, but still held by the allocator
    assert out["cached_after"] < 0.01 * total  # released to the driver: the engines can take it
    assert out["colocated/trainer_limit_gb"] == pytest.approx(0.2 * total / 1e9)
    assert out["capped_alloc"] == "oom"  # beyond the fraction: refused in the trainer
    assert out["lifted_alloc"] == int(0.25 * total)
