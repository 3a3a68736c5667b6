"""External engines (``slurm/engines.sbatch`` -> ``serve-engines``) span nodes as engines started
through Ray do (issue 35 item 4), and a TP that does not fit the job's nodes is refused.

References: SGLang 0.5.23's placement of a TP rank on a node (``entrypoints/engine.py``: ``gpu_id =
base_gpu_id + tp_rank % tp_size_per_node``, ``tp_size_per_node = tp_size // nnodes``, node ``r``
running TP ranks ``r * tp_size_per_node ...``) applied to the flags in each command line, against the
GPUs the process is given (``CUDA_VISIBLE_DEVICES``); the slow test reads the flags with SGLang's
own argument parser.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cluster.external_engines import ExternalEnginesError, engine_process, rendezvous, served_engines
from megarl.config.loader import load_config

REPO = Path(__file__).resolve().parents[3]
GPUS = [str(g) for g in range(8)]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _commands(cfg, num_nodes, registry, engines_per_node=1):
    """Every node's engine processes, as serve-engines builds them (node-rank 0's rendezvous first)."""
    out = []
    for node in range(num_nodes):
        for part in served_engines(cfg, name=f"n{node}", node_index=node, num_nodes=num_nodes,
                                   engines_per_node=engines_per_node, cuda=True, visible=GPUS):
            addr = rendezvous(part, host="127.0.0.1", base_port=int(cfg.rollout.engine.base_port),
                              registry=registry, timeout_s=1)
            out.append((part, engine_process(cfg, part, host="127.0.0.1", device="cuda", registry=registry,
                                             dist_init_addr=addr)))
    return out


def _sglang_gpus(cmd):
    """The GPU ordinals SGLang's TP ranks of this process would use (its own formula on the flags)."""
    tp, nnodes = int(_flag(cmd, "--tp")), int(_flag(cmd, "--nnodes") or 1)
    node_rank = int(_flag(cmd, "--node-rank") or 0)
    per_node = tp // nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    return sorted({r % per_node for r in ranks})  # base_gpu_id 0: megarl passes none


def test_kimi_k2_tp16_spans_two_8_gpu_nodes(tmp_path):
    cfg = load_config(REPO / "configs" / "kimi_k2_gpu.yaml")
    assert int(cfg.rollout.engine.tensor_parallel_size) == 16
    engines = _commands(cfg, 4, tmp_path)
    assert [p.engine_id for p, _ in engines] == ["engine0", "engine0.node1", "engine1", "engine1.node1"]
    for part, engine in engines:
        cmd = engine.command()
        visible = engine.environment(base={})["CUDA_VISIBLE_DEVICES"].split(",")
        assert (_flag(cmd, "--tp"), _flag(cmd, "--nnodes"), _flag(cmd, "--node-rank")) == ("16", "2", str(part.node_rank))
        assert _sglang_gpus(cmd) == list(range(len(visible))) == list(range(8))  # every rank on a visible GPU
        assert engine.environment(base={})["SGLANG_HOST_IP"] == "127.0.0.1"
    heads = {p.head_id: e.command() for p, e in engines if p.node_rank == 0}
    for part, engine in engines:  # a part joins its own engine's rendezvous, published by node-rank 0
        assert _flag(engine.command(), "--dist-init-addr") == _flag(heads[part.head_id], "--dist-init-addr")
        assert (tmp_path / f"{part.head_id}.rdzv").read_text() == _flag(heads[part.head_id], "--dist-init-addr")
    assert len({_flag(c, "--dist-init-addr") for c in heads.values()}) == 2


@pytest.mark.parametrize("num_nodes, per_node, match", [
    (1, 1, "the job has 1"),                    # TP16 on one 8-GPU node: SGLang would start it anyway
    (3, 1, "the job has 3"),                    # a part without its other half
    (2, 2, "MEGARL_ENGINES_PER_NODE=2"),        # two spanning engines cannot share a node
])
def test_a_tp_that_does_not_fit_the_nodes_is_refused(num_nodes, per_node, match):
    cfg = load_config(REPO / "configs" / "kimi_k2_gpu.yaml")
    with pytest.raises(ExternalEnginesError, match=f"tensor_parallel_size=16.*{match}"):
        served_engines(cfg, name="n0", node_index=0, num_nodes=num_nodes, engines_per_node=per_node,
                       cuda=True, visible=GPUS)


def test_one_node_engines_split_the_node_and_too_many_are_refused(tmp_path):
    cfg = load_config(REPO / "configs" / "deepseek_v3_gpu.yaml", ["rollout.engine.tensor_parallel_size=4",
                                                                  "rollout.engine.expert_parallel_size=4"])
    engines = _commands(cfg, 1, tmp_path, engines_per_node=2)
    assert [e.environment(base={})["CUDA_VISIBLE_DEVICES"] for _, e in engines] == ["0,1,2,3", "4,5,6,7"]
    for _, engine in engines:
        assert _flag(engine.command(), "--nnodes") is None
        assert _sglang_gpus(engine.command()) == [0, 1, 2, 3]
    with pytest.raises(ExternalEnginesError, match="3 engines per node.*need 12 devices per node, the job's nodes have 8"):
        served_engines(cfg, name="n0", node_index=0, num_nodes=1, engines_per_node=3, cuda=True, visible=GPUS)
    with pytest.raises(ExternalEnginesError, match="no GPU visible"):
        served_engines(cfg, name="n0", node_index=0, num_nodes=1, engines_per_node=1, cuda=True, visible=[])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sglangs_own_parser_reads_the_node_parts(tmp_path):
    cfg = load_config(REPO / "configs" / "kimi_k2_gpu.yaml")
    cmds = [e.command() for _, e in _commands(cfg, 2, tmp_path)]
    parse = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
             "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\nout = []\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    a = p.parse_args(argv)\n"
             "    out.append([a.tp_size, a.nnodes, a.node_rank, a.dist_init_addr, a.base_gpu_id])\n"
             "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", parse, json.dumps([c[3:] for c in cmds])],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    addr = (tmp_path / "engine0.rdzv").read_text()
    assert parsed == [[16, 2, 0, addr, 0], [16, 2, 1, addr, 0]]
    for tp, nnodes, rank, _, base in parsed:  # SGLang's gpu_id = base_gpu_id + tp_rank % tp_size_per_node
        assert {base + r % (tp // nnodes) for r in range(rank * tp // nnodes, (rank + 1) * tp // nnodes)} \
            == set(range(len(GPUS)))


def test_spanning_parts_bind_gloo_to_the_interface_of_their_address(tmp_path, monkeypatch):
    # Reference: the interface `ip` names for 127.0.0.1 (loopback), independent of psutil.
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    loopback = next(line.split()[1] for line in out.splitlines() if " 127.0.0.1/" in line)
    cfg = load_config(REPO / "configs" / "kimi_k2_gpu.yaml")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    for _, engine in _commands(cfg, 2, tmp_path):  # host 127.0.0.1 on both nodes
        assert engine.environment(base={})["GLOO_SOCKET_IFNAME"] == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # one the job sets is kept
    (tmp_path / "set").mkdir()
    for _, engine in _commands(cfg, 2, tmp_path / "set"):
        assert engine.environment(base={})["GLOO_SOCKET_IFNAME"] == "ib0"
    one_node = load_config(REPO / "configs" / "deepseek_v3_gpu.yaml")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    (tmp_path / "one").mkdir()
    for _, engine in _commands(one_node, 1, tmp_path / "one"):  # nothing crosses nodes: left alone
        assert "GLOO_SOCKET_IFNAME" not in engine.environment(base={})
