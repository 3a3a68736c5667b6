"""megarl.testing.multiproc: results by rank, errors and deaths reported, no hang on a stuck peer."""
import os
import time

import pytest

from megarl.procs.local_ranks import RankError
from megarl.testing.multiproc import run_ranks


def _sum_ranks(rank, world_size, scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "total": t.item() * scale, "omp": os.environ["OMP_NUM_THREADS"]}


def _rank1_raises_rank0_blocks(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def _rank0_exits(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(60)


def _sleeps(rank, world_size):
    time.sleep(60)


@pytest.mark.timeout(60)
def test_results_by_rank():
    out = run_ranks(_sum_ranks, 2, args=(10.0,), timeout_s=50)
    assert out == [{"rank": r, "total": 30.0, "omp": "1"} for r in range(2)]


@pytest.mark.timeout(60)
def test_error_kills_blocked_peer():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 of 2 raised.*boom on rank 1"):
        run_ranks(_rank1_raises_rank0_blocks, 2, timeout_s=50)
    assert time.monotonic() - start < 40


@pytest.mark.timeout(60)
def test_dead_rank_and_timeout():
    with pytest.raises(RankError, match="rank 0 exited with code 3"):
        run_ranks(_rank0_exits, 2, timeout_s=50, backend=None)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        run_ranks(_sleeps, 2, timeout_s=3, backend=None)
    assert time.monotonic() - start < 20
