"""The device rule (issue 18 items 1, 3, 4, 12): which CUDA device a rank selects from what it sees,
where a collective's tensors must live, the gloo control group, and the default group's timeout."""
from datetime import timedelta

import pytest
import torch

from megarl.training.collectives import collective_device
from megarl.training.devices import select_device_index


@pytest.mark.timeout(30)
@pytest.mark.parametrize("local_rank", range(8))
def test_ray_actor_with_one_gpu_selects_device_0_whatever_its_local_rank(local_rank):
    """Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU: the process sees one device, index 0
    (``set_device(LOCAL_RANK)`` fails for local ranks 1..7)."""
    assert select_device_index(visible_devices=str(local_rank), assigned_gpu_ids=[str(local_rank)],
                               local_rank=local_rank, device_count=1) == 0


@pytest.mark.timeout(30)
def test_device_index_is_the_position_of_rays_gpu_among_the_visible_ones():
    # an engine-sized actor (Ray GPUs 4, 5) and Ray told not to set CUDA_VISIBLE_DEVICES
    assert select_device_index(visible_devices="4,5", assigned_gpu_ids=["5"], local_rank=0, device_count=2) == 1
    assert select_device_index(visible_devices=None, assigned_gpu_ids=[3], local_rank=0, device_count=8) == 3
    assert select_device_index(visible_devices="0,1,2,3,4,5,6,7", assigned_gpu_ids=["6"], local_rank=1,
                               device_count=8) == 6


@pytest.mark.timeout(30)
def test_without_ray_one_visible_device_is_0_and_many_follow_local_rank():
    assert select_device_index(visible_devices="3", assigned_gpu_ids=[], local_rank=3, device_count=1) == 0
    assert select_device_index(visible_devices=None, assigned_gpu_ids=[], local_rank=5, device_count=8) == 5


@pytest.mark.timeout(30)
def test_device_rule_names_what_it_saw_when_no_device_fits():
    with pytest.raises(RuntimeError, match=r"CUDA_VISIBLE_DEVICES='2'.*Ray GPU ids \['5'\]"):
        select_device_index(visible_devices="2", assigned_gpu_ids=["5"], local_rank=0, device_count=1)
    with pytest.raises(RuntimeError, match="device index 3 is not visible"):
        select_device_index(visible_devices=None, assigned_gpu_ids=[], local_rank=3, device_count=2)


@pytest.mark.timeout(30)
def test_collective_tensors_go_to_the_groups_device():
    """nccl takes only CUDA tensors: a CPU tensor moves to this process's device; gloo / a
    ``cpu:gloo,cuda:nccl`` group keep it where it is."""
    cpu = torch.device("cpu")
    assert collective_device(cpu, ["cuda"], cuda_index=3) == torch.device("cuda", 3)
    assert collective_device(cpu, ["cuda", "cpu"]) == cpu
    assert collective_device(torch.device("cuda", 1), ["cuda"], cuda_index=1) == torch.device("cuda", 1)
    assert collective_device(torch.device("cuda", 0), ["cpu"]) == cpu
    with pytest.raises(ValueError):
        collective_device(cpu, [])


def _group_worker(rank, world_size):
    import torch.distributed as dist

    from megarl.config.schema import ParallelConfig
    from megarl.training import collectives
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(), backend="gloo", timeout_minutes=7)
    try:
        default = dist.distributed_c10d._get_default_group()
        # torch keeps the group's timeout on its backend's options
        timeout = default._get_backend(torch.device("cpu")).options._timeout
        total = collectives.all_reduce(torch.tensor([float(rank + 1)]))
        return collectives.group_devices(), collectives.control_group() is None, float(total), timeout
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.timeout(120)
def test_default_group_has_the_explicit_timeout_and_gloo_is_its_own_control_group():
    """Item 12: the default process group gets ``timeout_minutes`` (before: torch's default, 30 min
    for gloo); item 4: on gloo the control-plane group is the group itself (no extra group)."""
    from megarl.procs.local_ranks import free_port
    from megarl.testing.multiproc import run_ranks

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for supported, control_is_default, total, timeout in run_ranks(_group_worker, 2, backend=None, env=env,
                                                                  timeout_s=90):
        assert "cpu" in supported and control_is_default and total == 3.0
        assert timeout == timedelta(minutes=7)
