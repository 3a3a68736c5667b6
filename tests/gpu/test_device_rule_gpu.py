"""The device rule on a real GPU (issue 18 items 1, 3, 4, 5; ``@pytest.mark.gpu``, skipped without CUDA).

- A rank whose ``LOCAL_RANK`` is 3 but that sees one GPU (what Ray does) initialises NCCL and
  Megatron on device 0 (``set_device(LOCAL_RANK)`` raised "invalid device ordinal").
- Under NCCL, CPU tensors reduce through :mod:`megarl.training.collectives` (a plain
  ``dist.all_reduce`` of a CPU tensor on an NCCL group raises), the control group is gloo, and the
  weight synchronizer's metric reduction runs.
- Routes packed on the CPU replay on a CUDA router.
"""
import pytest
import torch

from megarl.procs.local_ranks import free_port
from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def _nccl_worker(rank, world_size):
    import torch.distributed as dist

    from megarl.config.schema import ParallelConfig
    from megarl.training import collectives
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(), backend="nccl", timeout_minutes=5)
    try:
        out = {"device": torch.cuda.current_device(), "backend": dist.get_backend(),
               "supported": collectives.group_devices()}
        try:
            dist.all_reduce(torch.ones(2))
            out["plain_cpu_all_reduce"] = "ok"
        except Exception as e:  # noqa: BLE001 - the failure this rule exists for
            out["plain_cpu_all_reduce"] = type(e).__name__
        reduced = collectives.all_reduce(torch.tensor([float(rank + 1)], dtype=torch.float64))
        out["reduced"], out["reduced_device"] = float(reduced), reduced.device.type
        host = torch.arange(3.0)  # a CPU tensor: broadcast and gathered on the GPU, results on the CPU
        collectives.broadcast(host, 0, async_op=True).wait()
        out["broadcast"] = (host.tolist(), host.device.type)
        out["gathered"] = [(p.tolist(), p.device.type) for p in collectives.all_gather(torch.tensor([5.0]))]
        out["group_device"] = str(collectives.group_device())
        control = collectives.control_group()
        out["control"] = dist.get_backend(control)
        dist.barrier(group=control)
        return out
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.timeout(300)
def test_rank_seeing_one_gpu_uses_device_0_and_cpu_collectives_follow_the_rule():
    last = str(torch.cuda.device_count() - 1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": last}
    # LOCAL_RANK=3 on a process that sees one GPU: run_ranks sets LOCAL_RANK=rank, so shift it
    out, = run_ranks(_local_rank_3, 1, backend=None, env=env, timeout_s=240, start_method="spawn")
    assert out["device"] == 0 and out["backend"] == "nccl" and out["supported"] == ["cuda"]
    assert out["plain_cpu_all_reduce"] != "ok"  # why the helper exists
    assert out["reduced"] == 1.0 and out["reduced_device"] == "cpu"
    assert out["broadcast"] == ([0.0, 1.0, 2.0], "cpu") and out["gathered"] == [([5.0], "cpu")]
    assert out["group_device"] == "cuda:0"
    assert out["control"] == "gloo"


def _local_rank_3(rank, world_size):
    import os

    os.environ["LOCAL_RANK"] = "3"
    return _nccl_worker(rank, world_size)


@pytest.mark.timeout(60)
def test_cpu_routes_replay_on_a_cuda_router():
    from megarl.training.routing_replay import _RouterSlot

    slot = _RouterSlot(0)
    slot.mode, slot.target = "replay", torch.tensor([[1, 0], [-1, -1]])
    scores = torch.randn(2, 4, device="cuda", requires_grad=True)
    probs, ids = slot.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
    assert ids.device.type == "cuda" and ids[0].tolist() == [1, 0]
    probs.sum().backward()
    assert scores.grad is not None


@pytest.mark.timeout(60)
def test_cuda_ipc_payload_names_the_device_by_uuid():
    """The server's ranks see other CUDA_VISIBLE_DEVICES: the payload must carry the UUID."""
    import base64
    import io
    import pickle

    from megarl.rollout.payloads import REBUILD_CUDA_DEVICE_ARG, serialize_named_tensors  # no aiohttp

    captured = []

    class Capture(pickle.Unpickler):
        def find_class(self, module, name):
            if name == "rebuild_cuda_tensor":
                return lambda *args: captured.append(args)
            return super().find_class(module, name)

    tensor = torch.arange(8.0, device="cuda")
    Capture(io.BytesIO(base64.b64decode(serialize_named_tensors([("w", tensor)])))).load()
    assert captured[0][REBUILD_CUDA_DEVICE_ARG] == str(torch.cuda.get_device_properties(tensor.device).uuid)
