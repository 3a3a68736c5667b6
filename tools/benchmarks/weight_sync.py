"""Weight-sync throughput on CPU (gloo) against a raw gloo broadcast of the same bytes, and the
bytes each engine rank receives per sync for large metadata-only layouts.

Part 1 (measured): a Qwen3-MoE of ``--size-gb`` (default 1.1 GB in bf16, random weights, written
once under ``--workdir``) is served by a real SGLang CPU server; two trainer ranks (gloo) hold its
Megatron shards at TP2 (built from the HF tensors with the family mapping, exactly what a trainer
holds) and push it with ``WeightSynchronizer`` (pause -> buckets -> flush -> version -> continue;
``weight_sync.bucket_size_mb`` buckets, TP gather over gloo, conversion, broadcast, engine load).
In the same run, interleaved with the syncs, rank 0 broadcasts the same number of bytes to rank 1
over a plain gloo group in buckets of the same size: the raw broadcast. Reported: median seconds
and GB/s of both, ``ratio = sync GB/s / raw GB/s`` (target >= 0.5), and the sync's
gather / convert / transfer / engine-load split. A verification step checks the engine's
logprobs after the last sync against the pushed weights' own (transformers, same dtype).

On a shared machine wall times swing with other load; ``ratio_cpu_time`` (CPU seconds of every
process involved: the two trainer ranks for the raw broadcast; the trainer ranks and the engine's
process tree for the sync) is the steadier efficiency number; both are reported. An idle SGLang CPU
server keeps up to one core busy (its scheduler polls; ``engine_idle_cpu_fraction``, measured
first), which the sync's CPU time includes and which competes with the trainer ranks for cores.

Side by side (``--transports p2p,distributed --engine-tp 2``): one engine at TP=2 and, in the same
run and interleaved, each transport's sync and a raw transfer of exactly each engine rank's own
bytes (its shard, from the plan) from trainer rank 0 to one extra plain process per engine rank
over gloo, in buckets of the same size (``raw_shard_s``): the floor a shard-to-shard transport can
reach on this machine. Reported per transport: medians, ``ratio_over_raw_shard = raw_shard_s /
sync_s``, the receivers' bytes / shard, and ``speedup_over_distributed``.

Part 2 (plan only): for Qwen3-235B-A22B- and DeepSeek-V3-shaped metadata, trainer TP x PP4 x EP16,
engines TP8 / TP16 with and without EP: bytes received per engine rank / its shard, for the
``distributed`` (full tensors broadcast) and ``shard`` transports.

usage: python tools/benchmarks/weight_sync.py [--size-gb 1.1] [--repeats 3] [--transport distributed]
       [--transports p2p,distributed --engine-tp 2] [--bucket-mb 256] [--workdir /tmp/megarl_ws_bench]
       [--skip-engine] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BIG = {
    "qwen3_235b_a22b": ({"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
                         "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                         "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
                         "num_experts_per_tok": 8, "vocab_size": 151936, "torch_dtype": "bfloat16"}, 4, 22, 24),
    "deepseek_v3": ({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                     "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
                     "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                     "num_experts_per_tok": 8, "first_k_dense_replace": 3, "vocab_size": 129280,
                     "torch_dtype": "bfloat16"}, 8, 15, 16),
}
"""name -> (config.json metadata, trainer TP, layers on the first / last of 4 pipeline stages)."""


def plan_ratios() -> dict:
    """Bytes per engine rank / shard for the big layouts (metadata only)."""
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    out = {}
    for name, (cfg, tp, first, last) in BIG.items():
        specs = param_specs_from_hf_config(cfg, tensor_model_parallel_size=tp)
        trainer = TrainerLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=4,
                                expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                                data_parallel_size=128 // tp, num_layers_in_first_pipeline_stage=first,
                                num_layers_in_last_pipeline_stage=last)
        for engine_tp, engine_ep in ((8, 1), (8, 8), (16, 1), (16, 16)):
            plan = build_plan(trainer, EngineLayout(tensor_parallel_size=engine_tp, expert_parallel_size=engine_ep),
                              specs)
            shard = plan.engine_shard_bytes()
            key = f"{name} trainer TP{tp}xPP4xEP16 -> engine TP{engine_tp} EP{engine_ep}"
            out[key] = {"model_gb": plan.total_bytes / 1e9, "buckets": len(plan.buckets),
                        "shard_gb_max": max(shard) / 1e9}
            for transport in ("distributed", "p2p"):
                received = plan.engine_rank_bytes(transport)
                out[key][f"{transport}_bytes_over_shard_max"] = max(r / s for r, s in zip(received, shard))
    return out


def make_model(workdir: Path, size_gb: float) -> Path:
    """A bf16 Qwen3-MoE of about ``size_gb`` GB (random weights, the tiny model's tokenizer)."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    layers = max(2, -(-int(size_gb * 1e9) // (64 * 3 * 1024 * 512 * 2)))
    out = workdir / f"qwen3_moe_{size_gb:g}gb"
    if not (out / "model.safetensors").exists() and not list(out.glob("*.safetensors")):
        make_tiny_model(out, TinyModelSpec(family="qwen3_moe", hidden_size=1024, num_hidden_layers=layers,
                                           num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                           moe_intermediate_size=512, num_experts=64, dtype="bfloat16"))
    return out


def local_shards(hf_dir: str, plan, rank: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron shards, made from the HF tensors with the family mapping."""
    from safetensors import safe_open

    from megarl.models.families import get_family
    from megarl.models.mapping import lookup, split_tp, to_megatron
    from megarl.training.model import load_hf_config

    hf_config = load_hf_config(hf_dir)
    family = get_family(hf_config)
    layout = family.layout(hf_config, tp_size=plan.trainer_layout.tp_size)
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    handles = [safe_open(str(f), "pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    shards = {}
    for bucket in plan.buckets:
        for transfer, source in bucket.contributions(rank):
            entry, _ = lookup(family.table, transfer.param.name)
            full = to_megatron(entry, [where[t.name].get_tensor(t.name) for t in transfer.param.hf], layout)
            shards[transfer.param.name] = split_tp(full, entry.tp_split, source.shard_index,
                                                   len(transfer.sources)).contiguous()
    return shards


def raw_broadcast_s(nbytes: int, bucket_bytes: int, group) -> float:
    """Seconds to broadcast ``nbytes`` from rank 0 to rank 1 over ``group`` in ``bucket_bytes`` chunks."""
    import torch.distributed as dist

    buffer = torch.empty(min(nbytes, bucket_bytes), dtype=torch.uint8)
    dist.barrier(group=group)
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        n = min(bucket_bytes, nbytes - sent)
        dist.broadcast(buffer[:n], src=0, group=group)
        sent += n
    dist.barrier(group=group)
    return time.perf_counter() - start


def engine_cpu_s(pid: int) -> float:
    """CPU seconds used so far by the engine's process tree (server, scheduler, detokenizer)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root] + root.children(recursive=True):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def bench_worker(rank: int, world_size: int, hf_dir: str, url: str, engine_pid: int, transport: str,
                 bucket_mb: float, repeats: int) -> dict | None:
    import torch.distributed as dist

    from megarl.config.schema import WeightSyncConfig
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.manifest_checks import read_manifest
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.sync import WeightSynchronizer

    hf_config = load_hf_config(hf_dir)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2, dtype="bfloat16")
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2), EngineLayout(), specs, bucket_size_mb=bucket_mb)
    shards = local_shards(hf_dir, plan, rank)
    from megarl.models.families import get_family

    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=bucket_mb)
    syncer = WeightSynchronizer(plan, transport, [url], rank=rank,
                                placement=Placement(get_family(hf_config).layout(hf_config, tp_size=2)),
                                manifest=read_manifest(hf_dir), directory=str(Path(hf_dir).parent / "disk"),
                                timeout_s=cfg.timeout_s)
    raw_group = dist.new_group(backend="gloo")
    syncs, raws, cpu = [], [], []
    idle = 0.0
    if rank == 0:  # the idle engine's own CPU use (SGLang's CPU scheduler polls), to subtract below
        e0, t0 = engine_cpu_s(engine_pid), time.perf_counter()
        time.sleep(2.0)
        idle = (engine_cpu_s(engine_pid) - e0) / (time.perf_counter() - t0)
    try:
        syncer.connect()
        for i in range(repeats):  # interleaved, so both see the same machine load
            c0 = time.process_time()
            raws.append(raw_broadcast_s(plan.total_bytes, plan.bucket_size_bytes, raw_group))
            c1, e1 = time.process_time(), engine_cpu_s(engine_pid) if rank == 0 else 0.0
            syncs.append(syncer.sync(shards, policy_version=i + 1))
            c2, e2 = time.process_time(), engine_cpu_s(engine_pid) if rank == 0 else 0.0
            both = torch.tensor([c1 - c0, c2 - c1 + e2 - e1], dtype=torch.float64)
            dist.all_reduce(both, group=raw_group)  # CPU seconds of every process involved
            cpu.append(both.tolist())
    finally:
        syncer.close()
    if rank != 0:
        return None
    return {"bytes": plan.total_bytes, "buckets": len(plan.buckets), "raw_s": raws, "sync": syncs, "cpu_s": cpu,
            "engine_idle_cpu_fraction": idle}


def raw_shards_s(shard_bytes: list[int], bucket_bytes: int, rank: int, group) -> float:
    """Seconds for rank 0 to send engine rank ``r``'s ``shard_bytes[r]`` to group rank ``2 + r``
    (all receivers at once, ``bucket_bytes`` per message, gloo point to point); ranks 2.. receive."""
    import torch.distributed as dist

    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    dist.barrier(group=group)
    start = time.perf_counter()
    if rank == 0:
        sent = [0] * len(shard_bytes)
        while any(s < n for s, n in zip(sent, shard_bytes)):
            works = []
            for r, n in enumerate(shard_bytes):
                k = min(bucket_bytes, n - sent[r])
                if k > 0:
                    works.append(dist.isend(buffer[:k], 2 + r, group=group))
                    sent[r] += k
            for w in works:
                w.wait()
    elif rank >= 2:
        got, n = 0, shard_bytes[rank - 2]
        while got < n:
            k = min(bucket_bytes, n - got)
            dist.recv(buffer[:k], 0, group=group)
            got += k
    dist.barrier(group=group)
    return time.perf_counter() - start


def side_by_side_worker(rank: int, world_size: int, hf_dir: str, url: str, engine_tp: int, transports: list[str],
                        bucket_mb: float, repeats: int) -> dict | None:
    """Ranks 0-1: the TP2 trainer; ranks 2..: one raw receiver per engine rank (see module docstring)."""
    import torch.distributed as dist

    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.manifest_checks import read_manifest
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.sync import WeightSynchronizer

    hf_config = load_hf_config(hf_dir)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2, dtype="bfloat16")
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2), EngineLayout(tensor_parallel_size=engine_tp),
                      specs, bucket_size_mb=bucket_mb)
    trainer_group = dist.new_group([0, 1], backend="gloo")
    everyone = dist.new_group(list(range(world_size)), backend="gloo")
    syncers = {}
    if rank < 2:
        shards = local_shards(hf_dir, plan, rank)
        placement = Placement(get_family(hf_config).layout(hf_config, tp_size=2))
        for t in transports:
            syncers[t] = WeightSynchronizer(plan, t, [url], rank=rank, placement=placement, group=trainer_group,
                                            manifest=read_manifest(hf_dir))
    shard_bytes = plan.engine_shard_bytes()
    raw, syncs = [], {t: [] for t in transports}
    try:
        for i in range(repeats):  # interleaved, so every variant sees the same machine load
            raw.append(raw_shards_s(shard_bytes, plan.bucket_size_bytes, rank, everyone))
            for t in transports:
                if rank < 2:
                    syncs[t].append(syncers[t].sync(shards, policy_version=i + 1))
                dist.barrier(group=everyone)
    finally:
        for syncer in syncers.values():
            syncer.close()
    if rank != 0:
        return None
    return {"bytes": plan.total_bytes, "buckets": len(plan.buckets), "shard_bytes": shard_bytes,
            "raw_shard_s": raw, "sync": syncs}


def side_by_side(hf_dir: Path, workdir: Path, engine_tp: int, transports: list[str], bucket_mb: float,
                 repeats: int) -> dict:
    from megarl.rollout.engine_process import EngineProcess
    from megarl.testing.multiproc import run_ranks
    from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

    engine = EngineProcess(hf_dir, device="cpu", dtype="bfloat16", tp_size=engine_tp, mem_fraction_static=0.35,
                           max_total_tokens=2048, grammar_backend="none",
                           custom_weight_loaders=CUSTOM_WEIGHT_LOADERS, env={"OMP_NUM_THREADS": "1"},
                           log_path=workdir / "engine_tp.log")
    engine.start()
    try:
        engine.wait_healthy(900)
        out = run_ranks(side_by_side_worker, 2 + engine_tp, timeout_s=3000, env={"OMP_NUM_THREADS": "1"},
                        args=(str(hf_dir), engine.url, engine_tp, transports, bucket_mb, repeats))[0]
        check = engine_check(engine.url, str(hf_dir))
    finally:
        engine.stop(grace_s=0)
    raw = statistics.median(out["raw_shard_s"])
    result = {"model_gb": out["bytes"] / 1e9, "buckets": out["buckets"], "engine_tp": engine_tp,
              "bucket_mb": bucket_mb, "shard_gb": [b / 1e9 for b in out["shard_bytes"]],
              "raw_shard_s": out["raw_shard_s"], "engine_check": check}
    for t, metrics in out["sync"].items():
        times = [m["timing/weight_sync_s"] for m in metrics]
        result[t] = {"sync_s": times, "median_s": statistics.median(times),
                     "ratio_over_raw_shard": raw / statistics.median(times),
                     "engine_bytes_over_shard_max": metrics[-1]["weight_sync/engine_bytes_over_shard_max"],
                     "split_last_sync_s": {k.split("/")[-1]: metrics[-1][k] for k in (
                         "weight_sync/gather_s", "weight_sync/convert_s", "weight_sync/transfer_s",
                         "weight_sync/engine_load_s")}}
    if "distributed" in out["sync"]:
        for t in out["sync"]:
            result[t]["speedup_over_distributed"] = result["distributed"]["median_s"] / result[t]["median_s"]
    return result


def engine_check(url: str, hf_dir: str) -> dict:
    """Engine logprobs on probes vs transformers on the same (bf16) weights: the sync delivered them."""
    from transformers import AutoModelForCausalLM

    from megarl.weight_sync.engine_clients import EngineClients
    from megarl.weight_sync.verify import engine_prompt_logprobs, logprob_gap

    gen = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (16, 24)]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    reference = []
    with torch.no_grad():
        for p in probes:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1)
            reference.append(lp.gather(1, torch.tensor(p[1:])[:, None])[:, 0].double())
    with EngineClients([url]) as engines:
        mean, peak = logprob_gap(engine_prompt_logprobs(engines, probes)[0], reference)
    return {"engine_vs_transformers_logprob_mean": mean, "max": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport", default="distributed")
    parser.add_argument("--transports", default=None,
                        help="comma-separated, e.g. p2p,distributed: side by side at --engine-tp with the raw "
                             "shard transfer")
    parser.add_argument("--engine-tp", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--workdir", default="/tmp/megarl_ws_bench")
    parser.add_argument("--skip-engine", action="store_true", help="only the plan-level byte ratios")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    result = {"plan_bytes_per_engine_rank": plan_ratios()}
    if args.transports and not args.skip_engine:
        workdir = Path(args.workdir)
        result["side_by_side"] = side_by_side(make_model(workdir, args.size_gb), workdir, args.engine_tp,
                                              args.transports.split(","), args.bucket_mb, args.repeats)
    elif not args.skip_engine:
        from megarl.rollout.engine_process import EngineProcess
        from megarl.testing.multiproc import run_ranks
        from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

        workdir = Path(args.workdir)
        hf_dir = make_model(workdir, args.size_gb)
        engine = EngineProcess(hf_dir, device="cpu", dtype="bfloat16", mem_fraction_static=0.2,
                               max_total_tokens=2048, grammar_backend="none",
                               custom_weight_loaders=CUSTOM_WEIGHT_LOADERS, env={"OMP_NUM_THREADS": "1"},
                               log_path=workdir / "engine.log")
        engine.start()
        try:
            engine.wait_healthy(600)
            out = run_ranks(bench_worker, 2, timeout_s=3000, env={"OMP_NUM_THREADS": "1"},
                            args=(str(hf_dir), engine.url, engine.pid, args.transport, args.bucket_mb,
                                  args.repeats))[0]
            result["engine_check"] = engine_check(engine.url, str(hf_dir))
        finally:
            engine.stop(grace_s=0)
        sync_s = [m["timing/weight_sync_s"] for m in out["sync"]]
        gb = out["bytes"] / 1e9
        raw, sync = statistics.median(out["raw_s"]), statistics.median(sync_s)
        last = out["sync"][-1]
        result["measured"] = {
            "model_gb": gb, "buckets": out["buckets"], "transport": args.transport, "bucket_mb": args.bucket_mb,
            "raw_broadcast_s": out["raw_s"], "sync_s": sync_s, "raw_gb_per_s": gb / raw, "sync_gb_per_s": gb / sync,
            "ratio_sync_over_raw": raw / sync,
            "cpu_s_raw_and_sync": out["cpu_s"],
            "ratio_cpu_time": (statistics.median(r for r, _ in out["cpu_s"])
                               / statistics.median(s for _, s in out["cpu_s"])),
            "engine_idle_cpu_fraction": out["engine_idle_cpu_fraction"],
            "split_last_sync_s": {k.split("/")[-1]: last[k] for k in (
                "weight_sync/gather_s", "weight_sync/convert_s", "weight_sync/transfer_s",
                "weight_sync/engine_load_s")},
            "engine_rank_bytes_over_shard": last["weight_sync/engine_bytes_over_shard_max"]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
