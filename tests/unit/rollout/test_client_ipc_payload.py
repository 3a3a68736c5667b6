"""CUDA-IPC weight payloads name the device by UUID, not index (issue 18 item 8). The CUDA half is
in tests/gpu/test_device_rule_gpu.py; here, the argument rewrite against torch's own signature."""
import base64
import inspect
import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from megarl.rollout.client import REBUILD_CUDA_DEVICE_ARG, device_uuid_args, serialize_named_tensors


@pytest.mark.timeout(30)
def test_the_rewritten_position_is_torchs_storage_device():
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert names[REBUILD_CUDA_DEVICE_ARG] == "storage_device"


@pytest.mark.timeout(30)
def test_device_index_becomes_the_uuid_and_a_uuid_is_kept():
    args = tuple(range(15))
    uuids = {6: "GPU-aaaa"}
    out = device_uuid_args(args[:6] + (6,) + args[7:], uuids.__getitem__)
    assert out[:6] == args[:6] and out[6] == "GPU-aaaa" and out[7:] == args[7:]
    assert device_uuid_args(out, uuids.__getitem__) == out


@pytest.mark.timeout(30)
def test_cpu_payloads_are_unchanged():
    payload = serialize_named_tensors([("w", torch.arange(4.0))])
    (name, tensor), = pickle.loads(base64.b64decode(payload))
    assert name == "w" and tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
