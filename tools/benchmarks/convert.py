#!/usr/bin/env python3
"""Benchmark HF -> Megatron -> HF conversion against ``shutil.copytree`` of the same files.

    python tools/benchmarks/convert.py [--model-dir DIR] [--tp 1 --ep 1 --pp 1] [--repeat 3] [--json OUT]

Builds (once, cached in --model-dir) a >= 1 GB random Qwen3-MoE with the tiny-model tool, then, in
one process: starts the rank fork server (imports torch, Megatron and the transformers config
classes once; reported as ``startup_s``) and, ``--repeat`` times, copies the HF directory with
``shutil.copytree`` and right after converts it to a Megatron dist checkpoint and back to HF.
Each timed phase starts and ends with ``os.sync()``: throughput is to disk, for the copy as for
the conversion. Reported: the medians (and every run) of the copy, import and export times, the
throughput ratio ``copytree_s / (hf_to_megatron_s + megatron_to_hf_s)`` of each copy/round-trip
pair (median, min, max; pairing them keeps a load change on the machine from landing on one side
only), and, in one more conversion, the peak memory (sum of PSS over this process, the fork
server and the rank processes, sampled every 0.2 s) against ``1 GB + 2 x the largest layer's
bytes``. Not part of the test suite.

What the ratio can reach: a round trip reads and writes the model twice, the copy once, so a
purely I/O-bound conversion scores 0.5. ``copytree`` copies inside the kernel (``sendfile``: page
cache to page cache) while a conversion copies page cache -> process memory -> page cache, and
each conversion also pays a fixed start-up of its own (a forked rank process, Megatron's parallel
state, the meta-device model, the DCP plan: ~0.3-0.5 s on 2 cores), so 0.5 is an upper bound the
conversion cannot reach on this hardware; the ratio measures how close it gets.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    from megarl.conversion.hf_io import HFCheckpointReader

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
    parser.add_argument("--repeat", type=int, default=3, help="copy / round-trip pairs to time")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        tool = Path(__file__).resolve().parents[1] / "make_tiny_model.py"
        subprocess.run([sys.executable, str(tool), str(model), "--family", "qwen3_moe", *SIZES], check=True)
    size = _weights_bytes(model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl_bench_convert_"))
    from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
    from megarl.testing.multiproc import run_ranks

    def timed(fn):
        # Every timed phase starts with an empty dirty-page budget and ends when its files are on
        # disk (os.sync), so that one phase's buffered writes do not throttle the next one.
        os.sync()
        start = time.perf_counter()
        fn()
        os.sync()
        return time.perf_counter() - start

    start = time.perf_counter()
    run_ranks(_noop, 1, backend=None)  # starts the fork server (imports torch, Megatron once)
    from megarl.training.model import load_hf_config

    load_hf_config(model)  # this process's one-time transformers imports
    startup_s = time.perf_counter() - start

    def convert(tag):
        ckpt, out = work / f"ckpt_{tag}", work / f"hf_{tag}"
        import_s = timed(lambda: hf_to_megatron(
            model, ckpt, tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep,
            pipeline_model_parallel_size=args.pp, expert_tensor_parallel_size=1 if args.ep > 1 else None))
        export_s = timed(lambda: megatron_to_hf_dir(ckpt, out))
        shutil.rmtree(ckpt)
        shutil.rmtree(out)
        return import_s, export_s

    runs = []
    for run in range(args.repeat):
        copy_s = timed(lambda: shutil.copytree(model, work / "copy"))
        shutil.rmtree(work / "copy")
        # Timed without the memory sampler (reading /proc/*/smaps competes for the CPU).
        import_s, export_s = convert(f"timed{run}")
        runs.append({"copytree_s": round(copy_s, 3), "hf_to_megatron_s": round(import_s, 3),
                     "megatron_to_hf_s": round(export_s, 3),
                     "ratio": round(copy_s / (import_s + export_s), 3)})
    with PeakMemory(interval_s=0.2) as memory:
        convert("memory")
    largest = _largest_layer_bytes(model)
    med = {k: statistics.median(r[k] for r in runs) for k in ("copytree_s", "hf_to_megatron_s", "megatron_to_hf_s")}
    ratios = [r["ratio"] for r in runs]
    gb = 1e9
    result = {
        "model_bytes": size, "largest_layer_bytes": largest, "layout": {"tp": args.tp, "ep": args.ep, "pp": args.pp},
        "repeat": args.repeat, "copytree_s": round(med["copytree_s"], 2),
        "copytree_gb_per_s": round(size / med["copytree_s"] / gb, 3), "startup_s": round(startup_s, 2),
        "hf_to_megatron_s": round(med["hf_to_megatron_s"], 2), "megatron_to_hf_s": round(med["megatron_to_hf_s"], 2),
        "roundtrip_gb_per_s": round(size / (med["hf_to_megatron_s"] + med["megatron_to_hf_s"]) / gb, 3),
        "ratio_roundtrip_vs_copytree": round(statistics.median(ratios), 3),
        "ratio_roundtrip_vs_copytree_min_max": [min(ratios), max(ratios)],
        "ratio_with_startup_vs_copytree": round(
            med["copytree_s"] / (startup_s + med["hf_to_megatron_s"] + med["megatron_to_hf_s"]), 3),
        "runs": runs,
        "peak_pss_bytes": memory.peak_bytes, "peak_target_bytes": 2**30 + 2 * largest,
        "ratio_peak_vs_target": round(memory.peak_bytes / (2**30 + 2 * largest), 3),
        "ratio_peak_vs_model": round(memory.peak_bytes / size, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
