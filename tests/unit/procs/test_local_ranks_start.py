"""`run_ranks` picks ``spawn`` where CUDA is available: a rank forked from the fork server cannot use
CUDA once Megatron-Core's import initialised it there (tools/gpu_check.sh on an H100:
"Cannot re-initialize CUDA in forked subprocess"). Which method ran is read from the child's parent
process: a spawned rank's parent is the caller, a forkserver rank's parent is the server."""
import os

import pytest
import torch

from megarl.procs import local_ranks


def _parent_pid(rank, world_size):
    return os.getppid()


@pytest.mark.timeout(180)
def test_spawn_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert local_ranks.default_start_method() == "spawn"
    (parent,) = local_ranks.run_ranks(_parent_pid, 1, backend=None, timeout_s=150)
    assert parent == os.getpid()


@pytest.mark.timeout(180)
def test_forkserver_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_ranks.default_start_method() == "forkserver"
    (parent,) = local_ranks.run_ranks(_parent_pid, 1, backend=None, timeout_s=150)
    assert parent != os.getpid()  # the fork server's child
