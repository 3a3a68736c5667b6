"""dist_convert binds each conversion rank to the GPU it was given, read from what it sees (issue 25).

A cluster that binds one GPU per task sets ``CUDA_VISIBLE_DEVICES`` to that one GPU while
``SLURM_LOCALID`` / ``LOCAL_RANK`` still count the tasks of the node: ``set_device(LOCAL_RANK)``
then asks for device 3 of a process that sees one. The reference below is independent of the
code: the task's physical GPU (its local id on a node with one GPU per task) and its position in
``CUDA_VISIBLE_DEVICES`` (CUDA renumbers the visible devices from 0 in that order).
No CUDA needed: ``torch.cuda`` is replaced by a recorder that stops before any process group.
"""
import pytest
import torch

from megarl.conversion import dist_convert

RENDEZVOUS_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                   "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID")


class _Bound(Exception):
    """Raised by the set_device recorder: the rank chose its device; no process group is started."""


def _expected(physical_gpu: int, visible: str | None) -> int:
    if visible is None:
        return physical_gpu
    return [d.strip() for d in visible.split(",")].index(str(physical_gpu))


# (environment, devices the process sees, the task's physical GPU)
CASES = {
    "slurm one GPU per task": ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3",
                                "SLURM_JOB_ID": "77", "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "3"}, 1, 3),
    "torchrun-style env, one GPU per task": ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "MASTER_ADDR": "h",
                                              "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "5"}, 1, 5),
    "torchrun, every GPU visible": ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "h",
                                     "MASTER_PORT": "29500"}, 4, 2),
    "slurm, the node's GPUs listed": ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                                       "SLURM_JOB_ID": "77", "MASTER_ADDR": "h", "CUDA_VISIBLE_DEVICES": "0,1"}, 2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_binds_the_gpu_it_was_given(case, monkeypatch):
    env, device_count, physical = CASES[case]
    for key in RENDEZVOUS_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # written by the code: restored
        monkeypatch.setenv(key, env.get(key, "0"))
        if key not in env:
            monkeypatch.delenv(key)
    rdzv = dist_convert.rendezvous_from_env(dict(env))
    bound = []

    def set_device(index):
        bound.append(index)
        raise _Bound

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(_Bound):
        dist_convert._init_process_group(rdzv, "auto", timeout_s=5)
    assert bound == [_expected(physical, env.get("CUDA_VISIBLE_DEVICES"))]


def test_a_local_rank_beyond_the_visible_devices_is_refused_naming_the_values():
    rdzv = dist_convert.Rendezvous(3, 4, 3, "h", 1, "RANK")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3.*2 visible devices"):
        dist_convert.cuda_device_index(rdzv, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2)
