"""An engine over several nodes (issue 25 part 4): each node part's command line and placement.

References: SGLang 0.5.23's own rules, restated from its source (``server_args.py`` /
``arg_groups``): ``--nnodes``, ``--node-rank``, ``--dist-init-addr host:port`` (IPv6 in brackets,
``utils/network.NetworkAddress.parse``), ``tp_size`` the whole engine's and divisible by the node
count (``validation_hook.check_server_args``); node ``r`` runs TP ranks ``r*tp/n .. (r+1)*tp/n - 1``
(``entrypoints/engine._calculate_rank_ranges``), so each node's CPU thread binding covers tp/n ranks.
The parse by SGLang's own parser is in tests/integration/rollout/test_engine_nodes_sglang_args.py.
"""
import pytest

from megarl.cluster.placement import engine_part_bundles
from megarl.rollout.engine_process import EngineProcess


def _part(rank, nnodes=2, tp=4, addr="10.0.0.1:29500", **kw):
    return EngineProcess("/m", host=f"10.0.0.{rank + 1}", port=30000, tp_size=tp, device="cpu", nnodes=nnodes,
                         node_rank=rank, dist_init_addr=addr, **kw)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_each_node_part_gets_the_same_engine_and_its_own_rank():
    cmds = [_part(r).command() for r in range(2)]
    for rank, cmd in enumerate(cmds):
        assert _flag(cmd, "--nnodes") == "2" and _flag(cmd, "--node-rank") == str(rank)
        assert _flag(cmd, "--dist-init-addr") == "10.0.0.1:29500"  # node-rank 0's address on every node
        assert _flag(cmd, "--tp") == "4"  # the whole engine's TP size, not the node's share
        assert _flag(cmd, "--host") == f"10.0.0.{rank + 1}"


def test_single_node_engine_has_no_node_flags():
    cmd = EngineProcess("/m", port=1, tp_size=2, device="cpu").command()
    assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(cmd)


def test_cpu_threads_bind_covers_this_nodes_ranks_only():
    env = _part(1).environment(base={})
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2  # 4 ranks over 2 nodes
    # one rank per node: still set (numa_utils.init_threads_binding asserts the *engine's* rank count
    # against the NUMA nodes when it is not), one group of cores
    assert len(_part(1, tp=2).environment(base={})["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 1


@pytest.mark.parametrize("kwargs", [dict(tp=3), dict(addr=None), dict(addr="10.0.0.1"), dict(addr="::1:29500")])
def test_invalid_node_layouts_are_refused(kwargs):
    with pytest.raises(ValueError):
        _part(0, **kwargs).command()  # no rendezvous yet: refused when the command is built
    with pytest.raises(ValueError):
        EngineProcess("/m", tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")


def test_ipv6_rendezvous_in_brackets_is_accepted():
    assert _flag(_part(0, addr="[fd00::1]:29500").command(), "--dist-init-addr") == "[fd00::1]:29500"


def test_parts_take_consecutive_nodes_in_node_order():
    # one whole-node bundle per node, listed by Ray in any order
    nodes = ["n2", "n0", "n3", "n1"]
    parts = engine_part_bundles(nodes, num_engines=2, parts=2, cuda=True)
    assert [[nodes[b] for b in p] for p in parts] == [["n2", "n0"], ["n3", "n1"]]
    assert sorted(b for p in parts for b in p) == [0, 1, 2, 3]


def test_two_parts_of_one_engine_on_one_gpu_node_are_refused():
    with pytest.raises(ValueError, match="rollout.engine.tensor_parallel_size"):
        engine_part_bundles(["a", "b", "a", "b"], num_engines=2, parts=2, cuda=True)
    assert engine_part_bundles(["a", "b", "a", "b"], num_engines=2, parts=2, cuda=False) == [[0, 2], [1, 3]]


def _actor(monkeypatch, node_ip, rank, **kw):
    """An EngineActor node part as if Ray had placed it on ``node_ip`` of a two-host cluster."""
    from megarl.rollout import engine_actor

    monkeypatch.setattr(engine_actor, "_cluster_addresses", lambda: (node_ip, ["10.1.2.3", "10.1.2.4"]))
    monkeypatch.setattr(engine_actor, "find_free_port", lambda host, start=None: 29500)  # not this machine's address
    return engine_actor.EngineActor("/m", device="cpu", tp_size=2, nnodes=2, node_rank=rank, **kw)


def test_node_rank_0_offers_its_own_address_as_the_rendezvous(monkeypatch):
    head = _actor(monkeypatch, "10.1.2.3", 0)  # rollout.engine.host: auto -> the node's address
    assert head.dist_init_addr() == "10.1.2.3:29500"
    assert head.engine.command()[-2:] == ["--dist-init-addr", "10.1.2.3:29500"]
    # SGLang's cross-node broadcast queue advertises this address (not a guess from 8.8.8.8)
    assert head.engine.environment(base={})["SGLANG_HOST_IP"] == "10.1.2.3"
    other = _actor(monkeypatch, "10.1.2.4", 1)
    assert other.engine.environment(base={})["SGLANG_HOST_IP"] == "10.1.2.4"
    with pytest.raises(RuntimeError, match="node-rank 0"):
        other.dist_init_addr()
    with pytest.raises(ValueError, match="dist_init_addr"):
        other.start(timeout_s=1)  # a part above rank 0 cannot start without node 0's rendezvous
