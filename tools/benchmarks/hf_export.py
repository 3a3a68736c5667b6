#!/usr/bin/env python3
"""Benchmark the Megatron -> HF export at 1 and 2 ranks against ``shutil.copytree`` of its bytes.

    python tools/benchmarks/hf_export.py [--model-dir DIR] [--ranks 1,2] [--repeat 3] [--json OUT]

Builds (once, cached in --model-dir) a >= 1 GB random Qwen3-MoE with the tiny-model tool and
converts it to a TP1 Megatron dist checkpoint (also cached), then, in one process: starts the rank
fork server (``startup_s``) and, ``--repeat`` times, copies the checkpoint directory with
``shutil.copytree`` and right after exports it to HF at each ``--ranks`` value
(:func:`megarl.conversion.convert.megatron_to_hf_dir`, the run's periodic export). Each timed phase
starts and ends with ``os.sync()``: throughput is to disk. Reported per rank count: the median
export time, the export's bytes/s (the HF files' bytes over the time) in all and per rank, and the
ratio ``copytree_s / export_s`` of each copy/export pair run back to back (median, min, max; the
pairing keeps a load change on the machine from landing on one side only); the speed-up of each
rank count over one rank, from the same round's exports; the 1-minute load average before and
after. Not part of the test suite; numbers in ``tools/benchmarks/hf_export.md``.

What the numbers can reach: an export reads the checkpoint once and writes the model once, as the
copy does, but the copy stays in the kernel (page cache to page cache) while each export rank
copies through its own memory and pays a fixed start-up (a forked process, Megatron's parallel
state, the meta model: ~0.3-0.5 s); two ranks can halve the time only where two cores are free
for them, which a shared 2-core machine rarely has (the load average says how far from it).
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
import time
from pathlib import Path

SIZES = ["--hidden-size", "1024", "--num-hidden-layers", "8", "--num-attention-heads", "16",
         "--num-key-value-heads", "4", "--head-dim", "64", "--moe-intermediate-size", "512",
         "--num-experts", "24", "--num-experts-per-tok", "4", "--intermediate-size", "2048"]


def _noop(rank, world_size):
    return rank


def _files_bytes(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in path.glob(pattern))


def _timed(fn) -> float:
    # Every timed phase starts with an empty dirty-page budget and ends when its files are on disk.
    os.sync()
    start = time.perf_counter()
    fn()
    os.sync()
    return time.perf_counter() - start


def _prepare(model: Path) -> Path:
    """The cached model and its TP1 dist checkpoint."""
    if not (model / "config.json").exists():
        tool = Path(__file__).resolve().parents[1] / "make_tiny_model.py"
        subprocess.run([sys.executable, str(tool), str(model), "--family", "qwen3_moe", *SIZES], check=True)
    ckpt = model.parent / (model.name + "_ckpt_tp1")
    if not (ckpt / "metadata.json").exists():
        from megarl.conversion.convert import hf_to_megatron

        hf_to_megatron(model, ckpt, overwrite=True)
    return ckpt


def _summary(runs: list[dict], ranks: int, size: int) -> dict:
    export_s = statistics.median(r[f"export_{ranks}_s"] for r in runs)
    ratios = [r["copytree_s"] / r[f"export_{ranks}_s"] for r in runs]
    speedups = [r["export_1_s"] / r[f"export_{ranks}_s"] for r in runs if "export_1_s" in r]
    return {"export_s": round(export_s, 3), "bytes_per_s": round(size / export_s),
            "bytes_per_s_per_rank": round(size / export_s / ranks),
            "ratio_copytree_vs_export": round(statistics.median(ratios), 3),
            "ratio_copytree_vs_export_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
            "speedup_vs_1_rank": round(statistics.median(speedups), 3) if speedups else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "megarl_bench_export_model"))
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--ranks", default="1,2", help="comma-separated export rank counts")
    parser.add_argument("--repeat", type=int, default=3, help="copy / export rounds to time")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    rank_counts = [int(r) for r in args.ranks.split(",")]

    ckpt = _prepare(Path(args.model_dir))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl_bench_export_"))
    from megarl.conversion.convert import megatron_to_hf_dir
    from megarl.testing.multiproc import run_ranks

    start = time.perf_counter()
    run_ranks(_noop, 1, backend=None)  # starts the fork server (imports torch, Megatron once)
    startup_s = time.perf_counter() - start
    load_before = os.getloadavg()[0]
    runs, size = [], 0
    for _ in range(args.repeat):
        run = {"copytree_s": _timed(lambda: shutil.copytree(ckpt, work / "copy"))}
        shutil.rmtree(work / "copy")
        for ranks in rank_counts:
            out = work / f"hf_{ranks}"
            run[f"export_{ranks}_s"] = _timed(lambda out=out, ranks=ranks: megatron_to_hf_dir(ckpt, out, ranks=ranks))
            size = _files_bytes(out, "*.safetensors")
            shutil.rmtree(out)
        runs.append({k: round(v, 3) for k, v in run.items()})
    result = {
        "hf_bytes": size, "checkpoint_bytes": _files_bytes(ckpt, "*.distcp"), "repeat": args.repeat,
        "cpu_count": os.cpu_count(), "startup_s": round(startup_s, 2),
        "copytree_s": round(statistics.median(r["copytree_s"] for r in runs), 3),
        "copytree_bytes_per_s": round(size / statistics.median(r["copytree_s"] for r in runs)),
        "ranks": {str(ranks): _summary(runs, ranks, size) for ranks in rank_counts},
        "runs": runs, "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
