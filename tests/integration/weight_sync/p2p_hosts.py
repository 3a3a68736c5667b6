"""The two sides of the cross-host ``p2p`` test, each run inside its emulated host (network namespace).

    python p2p_hosts.py engines MODEL ADDR NUM_ENGINES OUT_JSON LOG_DIR
        start NUM_ENGINES SGLang CPU servers at TP=2 bound to ADDR, write their URLs to OUT_JSON,
        serve until stdin closes
    python p2p_hosts.py trainer MODEL ADDR URLS_JSON WORKDIR OUT_JSON LAYOUT[,LAYOUT...] [CORRUPT_LAYOUT]
        for each trainer layout (2 ranks, gloo, master ADDR): train, sync the engines from disk
        (reference) and with p2p, read their logprobs; on CORRUPT_LAYOUT also inject a flipped byte
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def engines(model: str, addr: str, num: int, out: str, log_dir: str) -> None:
    from megarl.rollout.engine import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    procs = [EngineProcess(model, host=addr, tp_size=2, device="cpu", dtype="float32", mem_fraction_static=0.1,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"},
                           log_path=Path(log_dir) / f"engine{i}.log", engine_id=f"rollout-engine{i}")
             for i in range(num)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(600)
        Path(out).write_text(json.dumps([p.url for p in procs]))
        sys.stdin.read()  # until the test closes our stdin
    finally:
        for p in procs:
            p.stop(grace_s=0)


def trainer(model: str, addr: str, urls_json: str, workdir: str, out: str, layouts: str, corrupt: str = "") -> None:
    import os

    from megarl.testing.multiproc import run_ranks
    import p2p_workers
    from test_weight_sync_engine import probes, train_sequences

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    urls = json.loads(Path(urls_json).read_text())
    results = run_ranks(p2p_workers.across_layouts, 2, timeout_s=1500, env={"GLOO_SOCKET_IFNAME": "eth0"}, args=(
        model, layouts.split(","), urls, probes(), 2, workdir, train_sequences(), corrupt, addr))[0]
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "engines":
        engines(rest[0], rest[1], int(rest[2]), rest[3], rest[4])
    else:
        trainer(*rest)
