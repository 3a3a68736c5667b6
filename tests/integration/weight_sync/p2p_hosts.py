"""The two sides of the cross-host ``p2p`` test, each run inside its emulated host (network namespace).

    python p2p_hosts.py engines MODEL ADDR NUM_ENGINES OUT_JSON LOG_DIR HEALTHY_S
        start NUM_ENGINES SGLang CPU servers at TP=2 bound to ADDR, wait up to HEALTHY_S seconds in
        all for them to be healthy, write their URLs to OUT_JSON, serve until stdin closes
    python p2p_hosts.py trainer MODEL ADDR URLS_JSON WORKDIR OUT_JSON RANKS_S LAYOUT[,LAYOUT...] [CORRUPT_LAYOUT]
        for each trainer layout (2 ranks, gloo, master ADDR; the ranks get RANKS_S seconds in all):
        train, sync the engines from disk (reference) and with p2p, read their logprobs; on
        CORRUPT_LAYOUT also inject a flipped byte. Each rank's output goes to
        WORKDIR/logs/rank{r}.log, with every thread's stack dumped there every 300 s; this
        process's own stacks are dumped to its stderr as often.
"""
from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

DUMP_EVERY_S = 300.0
"""Interval of the stack dumps of a process that may hang."""


def engines(model: str, addr: str, num: int, out: str, log_dir: str, healthy_s: float) -> None:
    from megarl.rollout.engine_process import EngineProcess
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    deadline = time.monotonic() + healthy_s
    procs = [EngineProcess(model, host=addr, tp_size=2, device="cpu", dtype="float32", mem_fraction_static=0.1,
                           max_total_tokens=4096, grammar_backend="none", custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                           env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"},
                           log_path=Path(log_dir) / f"engine{i}.log", engine_id=f"rollout-engine{i}")
             for i in range(num)]
    try:
        for p in procs:
            p.start()
        for p in procs:  # one deadline for all: the test waits HEALTHY_S (plus a margin) for the URLs
            p.wait_healthy(max(1.0, deadline - time.monotonic()))
        Path(out).write_text(json.dumps([p.url for p in procs]))
        sys.stdin.read()  # until the test closes our stdin
    finally:
        for p in procs:
            p.stop(grace_s=0)


def trainer(model: str, addr: str, urls_json: str, workdir: str, out: str, ranks_s: str, layouts: str,
            corrupt: str = "") -> None:
    import os

    import p2p_workers
    from test_weight_sync_engine import probes, train_sequences

    from megarl.testing.multiproc import run_ranks

    faulthandler.dump_traceback_later(DUMP_EVERY_S, repeat=True)  # to stderr: the test's trainer.log
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    urls = json.loads(Path(urls_json).read_text())
    results = run_ranks(p2p_workers.across_layouts, 2, timeout_s=float(ranks_s), env={"GLOO_SOCKET_IFNAME": "eth0"},
                        args=(model, layouts.split(","), urls, probes(), 2, workdir, train_sequences(), corrupt, addr,
                              DUMP_EVERY_S))[0]
    Path(out).write_text(json.dumps(results))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "engines":
        engines(rest[0], rest[1], int(rest[2]), rest[3], rest[4], float(rest[5]))
    else:
        trainer(*rest)
