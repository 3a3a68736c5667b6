"""The command lines megarl builds for the node parts of an engine over several nodes, read by
SGLang 0.5.23's own parser and checked by its own validation (issue 25 part 4).

References: ``sglang.srt.server_args.prepare_server_args`` (the argv of ``sglang.launch_server``),
``ServerArgs.resolve_once`` then ``check_server_args`` (as ``entrypoints/engine.py`` does before
launching; ``arg_groups/validation_hook.py``: TP divisible by the node count) and
``utils/network.NetworkAddress.parse`` (how every node reads ``--dist-init-addr``). They run in one
subprocess with each part's own server environment (the CPU shims), as the server would. No server
is started here: tests/integration/rollout/test_engine_nodes_emulated.py serves a TP2 engine across
two emulated hosts; this covers the GPU-sized layouts (TP16, TP32) that cannot run on CPU.
"""
import json
import subprocess
import sys

import pytest

from megarl.rollout.engine_process import EngineProcess

HEAD = "10.0.0.1:29500"
LAYOUTS = [(2, 1, 2), (16, 16, 2), (32, 8, 4)]
"""(tp, ep, nnodes): the CPU test's TP2 over two hosts, DeepSeek-V3 / Kimi-K2-sized engines."""

SGLANG_READS = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.network import NetworkAddress
out = []
for argv in json.load(sys.stdin):
    args = prepare_server_args(argv)
    row = {k: getattr(args, k) for k in ("nnodes", "node_rank", "dist_init_addr", "tp_size", "ep_size", "host", "port")}
    try:
        args.resolve_once()
        args.check_server_args()
        row["check"] = "ok"
    except AssertionError as e:
        row["check"] = str(e)
    addr = NetworkAddress.parse(args.dist_init_addr)
    row["addr"] = [addr.host, addr.port]
    out.append(row)
print("RESULT " + json.dumps(out))
"""


def _argv(engine: EngineProcess) -> list[str]:
    cmd = engine.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    return cmd[3:]


def _sglang_reads(argvs: list[list[str]], env: dict) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", SGLANG_READS], input=json.dumps(argvs), capture_output=True,
                          text=True, env=env, timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_node_part_parses_and_passes_sglangs_checks(tiny_moe_dir):
    parts, expected = [], []
    for tp, ep, nnodes in LAYOUTS:
        for rank in range(nnodes):
            parts.append(EngineProcess(tiny_moe_dir, host=f"10.0.0.{rank + 1}", port=30000 + rank, tp_size=tp,
                                       ep_size=ep, device="cpu", nnodes=nnodes, node_rank=rank, dist_init_addr=HEAD))
            expected.append(dict(nnodes=nnodes, node_rank=rank, dist_init_addr=HEAD, tp_size=tp, ep_size=ep,
                                 host=f"10.0.0.{rank + 1}", port=30000 + rank, check="ok", addr=["10.0.0.1", 29500]))
    ipv6 = EngineProcess(tiny_moe_dir, port=30000, tp_size=2, device="cpu", nnodes=2, node_rank=1,
                         dist_init_addr="[fd00::1]:29500")
    # TP 3 over 2 nodes: megarl refuses to build it; SGLang's own check must refuse the same argv
    with pytest.raises(ValueError, match="multiple of its nnodes"):
        EngineProcess(tiny_moe_dir, tp_size=3, nnodes=2, node_rank=0, dist_init_addr=HEAD)
    odd = _argv(EngineProcess(tiny_moe_dir, port=30000, tp_size=3, device="cpu"))
    odd += ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", HEAD]

    rows = _sglang_reads([_argv(p) for p in parts] + [_argv(ipv6), odd], parts[0].environment())
    assert rows[:len(parts)] == expected
    assert rows[len(parts)]["addr"] == ["fd00::1", 29500]
    assert "divisible by number of nodes" in rows[-1]["check"]
