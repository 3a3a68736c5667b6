"""The one device rule (issue 18 item 3): every collective in megarl goes through
:mod:`megarl.training.collectives`, which runs it on the group's device.

- A scan of the package's syntax trees finds no direct ``torch.distributed`` collective outside
  the helper (the scanner itself is checked on sources that break the rule).
- On a gloo group the helper keeps CPU tensors where they are, and every wrapper moves the data
  it should (2 ranks, values against their formulas).
- With a group that supports only CUDA (resolver mocked; no CUDA is touched) a CPU tensor runs
  on this process's CUDA device and a receiver's result comes back to the caller's tensor.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megarl.training import collectives

PACKAGE = Path(collectives.__file__).resolve().parents[1]
HELPER = Path(collectives.__file__).resolve()

COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "gather", "gather_object",
    "scatter", "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "barrier", "monitored_barrier", "_all_gather_base", "_reduce_scatter_base"})
"""``torch.distributed`` functions that move tensors between ranks (not group management such as
``new_group`` / ``destroy_process_group`` / ``get_rank``)."""

ALLOWED: dict[tuple[str, str], str] = {}
"""``(path relative to megarl/, function) -> why`` a module may call ``torch.distributed`` directly.
Empty: even the SGLang-side receiver goes through the helper (SGLang's group is a torch
``ProcessGroup`` whose backends the helper reads like any other)."""


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """``(line, function)`` for each reference to a ``torch.distributed`` collective in ``source``."""
    tree = ast.parse(source)
    aliases = set()  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    found.append((node.lineno, a.name))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in COLLECTIVES:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in aliases:
            found.append((node.lineno, node.attr))
        elif (isinstance(owner, ast.Attribute) and owner.attr in ("distributed", "distributed_c10d")
              and isinstance(owner.value, (ast.Name, ast.Attribute))):
            chain = ast.unparse(owner)
            if chain in ("torch.distributed", "torch.distributed.distributed_c10d") or \
                    (isinstance(owner.value, ast.Name) and owner.value.id in aliases):
                found.append((node.lineno, node.attr))
    return sorted(found)


@pytest.mark.timeout(60)
def test_the_scanner_sees_every_way_of_calling_a_collective_directly():
    bad = ("import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
           "from torch.distributed import send\n"
           "d.all_reduce(x)\n"                      # line 5
           "torch.distributed.broadcast(x, 0)\n"    # line 6
           "op = d.recv if flag else d.isend\n"      # line 7: referenced, called later
           "distributed.barrier()\n"                # line 8
           "d.distributed_c10d.all_gather(p, x)\n")  # line 9
    assert direct_collectives(bad) == [(4, "send"), (5, "all_reduce"), (6, "broadcast"), (7, "isend"),
                                       (7, "recv"), (8, "barrier"), (9, "all_gather")]
    fine = ("import torch.distributed as dist\nfrom megarl.training.collectives import all_reduce\n"
            "all_reduce(x, op=dist.ReduceOp.MAX)\ndist.get_rank(); dist.destroy_process_group(g)\n"
            "self.send(x); engines.broadcast(y)\n")
    assert direct_collectives(fine) == []


@pytest.mark.timeout(60)
def test_no_module_outside_the_helper_calls_torch_distributed_collectives():
    violations, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == HELPER:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in direct_collectives(path.read_text(encoding="utf-8")):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                violations.append(f"megarl/{rel}:{line}: torch.distributed.{name}")
    assert not violations, ("call megarl.training.collectives instead (it runs the collective on the "
                            "group's device):\n" + "\n".join(violations))
    assert used == set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - used}"


@pytest.mark.timeout(30)
def test_a_cpu_tensor_runs_on_this_processs_cuda_device_under_a_cuda_only_group(monkeypatch):
    """nccl's capability with the resolvers mocked: no CUDA call is made. The stand-in for the
    CUDA copy records where the helper sent the tensor; the stand-in collective doubles it."""
    moves = []
    monkeypatch.setattr(collectives, "group_devices", lambda group=None: ["cuda"])
    monkeypatch.setattr(collectives, "current_cuda_index", lambda supported: 3)
    monkeypatch.setattr(collectives, "_move", lambda t, device: moves.append(device) or t.clone())
    ran_on = []

    def fake_all_reduce(t, op=None, group=None, async_op=False):
        ran_on.append(t)
        t.mul_(2)

    monkeypatch.setattr(collectives.dist, "all_reduce", fake_all_reduce)
    assert collectives.group_device() == torch.device("cuda", 3)
    host = torch.tensor([1.0, 2.0])
    assert collectives.all_reduce(host) is host
    assert moves == [torch.device("cuda", 3)] and ran_on[0] is not host  # ran on the copy
    assert host.tolist() == [2.0, 4.0]  # the result came back to the caller's tensor


@pytest.mark.timeout(30)
def test_an_async_receive_on_a_moved_tensor_lands_in_the_callers_tensor_at_wait(monkeypatch):
    class Work:
        def __init__(self):
            self.waited = False

        def is_completed(self):
            return True

        def wait(self, timeout=None):
            self.waited = True

    work = Work()
    monkeypatch.setattr(collectives, "group_devices", lambda group=None: ["cuda"])
    monkeypatch.setattr(collectives, "current_cuda_index", lambda supported: 0)
    monkeypatch.setattr(collectives, "_move", lambda t, device: t.clone())

    def fake_irecv(t, src, group=None, tag=0):
        t.fill_(7.0)  # the data arrives in the copy on the group's device
        return work

    monkeypatch.setattr(collectives.dist, "irecv", fake_irecv)
    host = torch.zeros(3)
    handle = collectives.irecv(host, 1, tag=5)
    assert isinstance(handle, collectives.MovedWork) and handle.is_completed()
    assert host.tolist() == [0.0, 0.0, 0.0]  # not before wait()
    handle.wait()
    assert work.waited and host.tolist() == [7.0, 7.0, 7.0]


def _wrappers_worker(rank, world_size):
    import torch.distributed as dist

    out = {"group_device": str(collectives.group_device()), "supported": collectives.group_devices()}
    t = torch.arange(4, dtype=torch.float32)
    out["kept"] = collectives.on_group_device(t) is t
    x = torch.full((3,), float(rank + 1))
    collectives.all_reduce(x, op=dist.ReduceOp.MAX)
    out["max"] = x.tolist()
    y = torch.full((2,), float(rank + 1))
    collectives.all_reduce(y, async_op=True).wait()
    out["sum"] = y.tolist()
    b = torch.arange(5, dtype=torch.float64) * 10 if rank == 0 else torch.zeros(5, dtype=torch.float64)
    collectives.broadcast(b, 0, async_op=True).wait()
    out["broadcast"] = b.tolist()
    received = torch.zeros(4, dtype=torch.int64)
    works = [collectives.isend(torch.arange(4) + 100 * rank, 1 - rank, tag=9),
             collectives.irecv(received, 1 - rank, tag=9)]
    for w in works:
        w.wait()
    out["irecv"] = received.tolist()
    token = torch.tensor([rank + 0.5])
    if rank == 0:
        collectives.send(token, 1)
    else:
        collectives.recv(token, 0)
    out["token"] = token.item()
    out["gathered"] = [p.tolist() for p in collectives.all_gather(torch.tensor([rank, rank * 2]))]
    collectives.barrier()
    box = [{"from": rank}]
    collectives.broadcast_object_list(box, src=0)
    out["object"] = box[0]
    out["objects"] = collectives.all_gather_object(f"rank{rank}")
    return out


@pytest.mark.timeout(120)
def test_every_wrapper_moves_the_right_data_on_a_gloo_group():
    from megarl.testing.multiproc import run_ranks

    outs = run_ranks(_wrappers_worker, 2, timeout_s=90)
    for rank, out in enumerate(outs):
        assert out["group_device"] == "cpu" and "cpu" in out["supported"] and out["kept"]
        assert out["max"] == [2.0] * 3 and out["sum"] == [3.0, 3.0]
        assert out["broadcast"] == [0.0, 10.0, 20.0, 30.0, 40.0]
        assert out["irecv"] == [100 * (1 - rank) + i for i in range(4)]
        assert out["token"] == 0.5
        assert out["gathered"] == [[0, 0], [1, 2]]
        assert out["object"] == {"from": 0} and out["objects"] == ["rank0", "rank1"]
