#!/usr/bin/env python3
"""Benchmark HF -> Megatron -> HF conversion against ``shutil.copytree`` of the same files.

    python tools/benchmarks/convert.py [--model-dir DIR] [--tp 1 --ep 1 --pp 1] [--json OUT]

Builds (once, cached in --model-dir) a >= 1 GB random Qwen3-MoE with the tiny-model tool, then, in
one run: copies the HF directory with ``shutil.copytree``; starts the rank fork server (imports
torch, Megatron and the transformers config classes once; reported as ``startup_s``); converts the model to a Megatron dist
checkpoint and back to HF; and reports throughput (model bytes / seconds) of each, their ratio
(without and with the start-up), and, in a second conversion, the peak memory (sum of PSS over
this process, the fork server and the rank processes, sampled every 0.2 s), against the target ``1 GB + 2 x the largest layer's bytes``. Each timed phase
starts and ends with ``os.sync()``: throughput is to disk, for the copy as for the conversion.
Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

SIZES = ["--hidden-size", "1024", "--num-hidden-layers", "6", "--num-attention-heads", "16",
         "--num-key-value-heads", "4", "--head-dim", "64", "--moe-intermediate-size", "512",
         "--num-experts", "32", "--num-experts-per-tok", "4", "--intermediate-size", "2048"]


class PeakMemory:
    """Samples the summed PSS of this process and its descendants in a thread."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s, self.peak_bytes, self._stop = interval_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.peak_bytes = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _noop(rank, world_size):
    return rank


def _weights_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _largest_layer_bytes(path: Path) -> int:
    from megarl.checkpoint.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(path)
    layers: dict[str, int] = {}
    for name in reader.keys():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        layers[key] = layers.get(key, 0) + reader.nbytes(name)
    return max(layers.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "megarl_bench_convert_model"))
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        tool = Path(__file__).resolve().parents[1] / "make_tiny_model.py"
        subprocess.run([sys.executable, str(tool), str(model), "--family", "qwen3_moe", *SIZES], check=True)
    size = _weights_bytes(model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl_bench_convert_"))
    from megarl.checkpoint.convert import hf_to_megatron, megatron_to_hf_dir
    from megarl.testing.multiproc import run_ranks

    # Every timed phase starts with an empty dirty-page budget and ends when its files are on disk
    # (os.sync), so that one phase's buffered writes do not throttle the next one.
    os.sync()
    start = time.perf_counter()
    shutil.copytree(model, work / "copy")
    os.sync()
    copy_s = time.perf_counter() - start
    start = time.perf_counter()
    run_ranks(_noop, 1, backend=None)  # starts the fork server (imports torch, Megatron once)
    from megarl.training.model import load_hf_config

    load_hf_config(model)  # this process's one-time transformers imports
    startup_s = time.perf_counter() - start

    def convert(tag):
        os.sync()
        start = time.perf_counter()
        ckpt = hf_to_megatron(model, work / f"ckpt_{tag}", tensor_model_parallel_size=args.tp,
                              expert_model_parallel_size=args.ep, pipeline_model_parallel_size=args.pp,
                              expert_tensor_parallel_size=1 if args.ep > 1 else None)
        os.sync()
        middle = time.perf_counter()
        megatron_to_hf_dir(ckpt, work / f"hf_{tag}")
        os.sync()
        return middle - start, time.perf_counter() - middle

    # Timed without the memory sampler (reading /proc/*/smaps competes for the CPU), then again
    # with it for the peak.
    import_s, export_s = convert("timed")
    with PeakMemory(interval_s=0.2) as memory:
        convert("memory")
    largest = _largest_layer_bytes(model)
    gb = 1e9
    result = {
        "model_bytes": size, "largest_layer_bytes": largest, "layout": {"tp": args.tp, "ep": args.ep, "pp": args.pp},
        "copytree_s": round(copy_s, 2), "copytree_gb_per_s": round(size / copy_s / gb, 3),
        "startup_s": round(startup_s, 2),
        "hf_to_megatron_s": round(import_s, 2), "megatron_to_hf_s": round(export_s, 2),
        "roundtrip_gb_per_s": round(size / (import_s + export_s) / gb, 3),
        "ratio_roundtrip_vs_copytree": round(copy_s / (import_s + export_s), 3),
        "ratio_with_startup_vs_copytree": round(copy_s / (startup_s + import_s + export_s), 3),
        "peak_pss_bytes": memory.peak_bytes, "peak_target_bytes": 2**30 + 2 * largest,
        "ratio_peak_vs_target": round(memory.peak_bytes / (2**30 + 2 * largest), 3),
        "ratio_peak_vs_model": round(memory.peak_bytes / size, 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
