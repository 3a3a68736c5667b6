"""Owner senders across emulated hosts: bytes per trainer rank and per engine rank, and the sync's
wall time against a raw transfer of the same bytes (issue 34 part 1's measurement).

Layout shaped like the DeepSeek-V3 recipe in small: trainer TP2 EP2 ETP1 (2 gloo ranks, one
expert-data-parallel copy, experts spread over every rank, one dense copy) on one emulated host
(its own network namespace and address, ``megarl.testing.netns``), two SGLang CPU engines of TP2 on
another. The model is ``weight_sync.py``'s random bf16 Qwen3-MoE of ``--size-gb``; the trainer
ranks hold its Megatron shards (made from the HF tensors with the family mapping, as
``weight_sync.py`` does; every rank holding a shard gets it). Each repeat, interleaved: a sync
with ``p2p`` + ``weight_sync.senders: owner``, and the raw transfer: every trainer rank sends, per
bucket, exactly the bytes the plan has it send to each engine rank (``OwnerParts``) to one plain
process per engine rank on the engines' host over gloo, all pairs at once. Reported: medians,
``ratio_over_raw = raw_s / sync_s``, bytes each trainer rank sent (its transport's count) against
the plan's, bytes each engine rank received (counted by the receivers inside the servers) over its
shard, the load average before and after.

The plan is the owner senders' own, as ``build_weight_sync`` builds it: each layer's experts spread
over the buckets (``spread_experts``), the buckets packed into rounds that load every link alike
(``senders.plan_rounds``); the raw transfer moves each round's bytes, all pairs at once, round
after round.

``--pp 2``: the trainer in two pipeline stages (TP2 PP2 EP2 ETP1, 4 ranks): both stages deliver at
once through one group, their buckets in the same rounds.

usage (root, for the namespaces): python tools/benchmarks/weight_sync_hosts.py [--size-gb 0.4]
       [--repeats 3] [--bucket-mb 64] [--pp 1] [--workdir /tmp/megarl_ws_hosts] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RAW_PORT = 29650
"""The raw transfer's group port on the trainer host (its own namespace: nothing else there)."""
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}


def _plan(hf_dir: str, bucket_mb: float, pp: int = 1):
    """``(plan, placement, OwnerParts)`` of the measured layout (the same on both hosts)."""
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.owners import OwnerParts
    from megarl.weight_sync.plan import build_plan

    hf_config = load_hf_config(hf_dir)
    trainer = TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp, expert_model_parallel_size=2,
                            expert_tensor_parallel_size=1)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2, dtype="bfloat16")
    plan = build_plan(trainer, EngineLayout(tensor_parallel_size=2, num_engines=2), specs, bucket_size_mb=bucket_mb,
                      senders_per_stage=1, spread_experts=True)
    placement = Placement(get_family(hf_config).layout(hf_config, tp_size=2))
    return plan, placement, OwnerParts(plan, placement)


def pair_bytes(parts, plan) -> dict:
    """``{(round, trainer rank, engine, engine rank): bytes}`` the owner senders send (``parts.rounds()``)."""
    out: dict = {}
    for k, buckets in enumerate(parts.rounds()):
        for b in buckets:
            for e in range(plan.engine_layout.num_engines):
                for r in range(plan.engine_layout.tp_size):
                    for p in parts.parts(b, e, r):
                        key = (k, p.sender, e, r)
                        out[key] = out.get(key, 0) + p.nbytes
    return out


def holder_shards(hf_dir: str, plan, rank: int) -> dict:
    """Every Megatron shard ``rank`` holds (``senders.holders``), from the HF tensors."""
    from safetensors import safe_open

    from megarl.models.families import get_family
    from megarl.models.mapping import lookup, split_tp, to_megatron
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.senders import holders

    hf_config = load_hf_config(hf_dir)
    family = get_family(hf_config)
    layout = family.layout(hf_config, tp_size=plan.trainer_layout.tp_size)
    handles = [safe_open(str(f), "pt") for f in sorted(Path(hf_dir).glob("*.safetensors"))]
    where = {k: h for h in handles for k in h.keys()}
    shards = {}
    for bucket in plan.buckets:
        for transfer in bucket.params:
            for source in transfer.sources:
                if rank in holders(plan, transfer, source):
                    entry, _ = lookup(family.table, transfer.param.name)
                    full = to_megatron(entry, [where[t.name].get_tensor(t.name) for t in transfer.param.hf], layout)
                    shards[transfer.param.name] = split_tp(full, entry.tp_split, source.shard_index,
                                                           len(transfer.sources)).contiguous()
    return shards


def raw_transfer(pairs: dict, plan, group_rank: int, group) -> float:
    """Seconds of the raw transfer (module docstring), round after round; the trainer ranks
    ``0 .. W - 1`` send, ``W ..`` receive."""
    import torch
    import torch.distributed as dist

    tp, world = plan.engine_layout.tp_size, plan.trainer_layout.world_size
    dist.barrier(group=group)
    start = time.perf_counter()
    for k in sorted({key[0] for key in pairs}):
        works = []
        for (index, t, e, r), n in pairs.items():
            if index != k:
                continue
            if group_rank == t:
                works.append(dist.isend(torch.empty(n, dtype=torch.uint8), world + e * tp + r, group=group))
            elif group_rank == world + e * tp + r:
                works.append(dist.irecv(torch.empty(n, dtype=torch.uint8), t, group=group))
        for w in works:
            w.wait()
    dist.barrier(group=group)
    return time.perf_counter() - start


def _raw_group(addr: str, group_rank: int, world: int):
    from datetime import timedelta

    from megarl.weight_sync.sglang_compat import init_custom_process_group

    return init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{RAW_PORT}", world_size=world,
                                     rank=group_rank, group_name="raw", timeout=timedelta(seconds=1200))


def receiver_proc(k: int, hf_dir: str, trainer_addr: str, bucket_mb: float, repeats: int, pp: int) -> None:
    """Raw receiver ``k`` (engine ``k // 2`` rank ``k % 2``) on the engines' host."""
    os.environ.update(ENV)
    plan, _, parts = _plan(hf_dir, bucket_mb, pp)
    world = plan.trainer_layout.world_size
    group = _raw_group(trainer_addr, world + k, world + 4)
    pairs = pair_bytes(parts, plan)
    for _ in range(repeats):
        raw_transfer(pairs, plan, world + k, group)


def trainer_rank(rank: int, world_size: int, hf_dir: str, urls: list[str], addr: str, bucket_mb: float,
                 repeats: int, pp: int) -> dict | None:
    import torch.distributed as dist

    from megarl.weight_sync.sync import WeightSynchronizer

    plan, placement, parts = _plan(hf_dir, bucket_mb, pp)
    shards = holder_shards(hf_dir, plan, rank)
    raw_group = _raw_group(addr, rank, world_size + 4)
    pairs = pair_bytes(parts, plan)
    syncer = WeightSynchronizer(plan, "p2p", urls, rank=rank, placement=placement, senders="owner",
                                master_address=addr)
    raw, syncs, sent = [], [], []
    try:
        for i in range(repeats + 1):  # the first sync creates the groups and touches the buffers: not counted
            if i:
                raw.append(raw_transfer(pairs, plan, rank, raw_group))
            dist.barrier()
            syncer.transport.stats.bytes_sent = 0
            metrics = syncer.sync(shards, policy_version=i + 1)
            everyone = [None] * world_size
            dist.all_gather_object(everyone, syncer.transport.stats.bytes_sent)
            if i:
                syncs.append(metrics)
                sent.append(everyone)
    finally:
        syncer.close()
    if rank:
        return None
    return {"raw_s": raw, "sync": syncs, "sent": sent,
            "planned_sent": [parts.sends.sent.get(r, 0) for r in range(world_size)],
            "shard_bytes": plan.engine_shard_bytes(), "hf_bytes": plan.total_bytes, "buckets": len(plan.buckets),
            "rounds": [[b.index for b in r] for r in parts.rounds()]}


def side(argv: list[str]) -> None:
    """One host's part (run inside its namespace by :func:`main`)."""
    command, hf_dir, addr, out, bucket_mb, repeats, pp = argv[:7]
    bucket_mb, repeats, pp = float(bucket_mb), int(repeats), int(pp)
    os.environ.update(ENV)
    if command == "engines":
        from megarl.rollout.engine_process import EngineProcess
        from megarl.weight_sync.sglang_loader import CUSTOM_WEIGHT_LOADERS

        procs = [EngineProcess(hf_dir, host=addr, tp_size=2, device="cpu", dtype="bfloat16", mem_fraction_static=0.2,
                               max_total_tokens=2048, grammar_backend="none",
                               custom_weight_loaders=CUSTOM_WEIGHT_LOADERS,
                               env=ENV, log_path=Path(out).parent / f"engine{i}.log", engine_id=f"engine{i}")
                 for i in range(2)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.wait_healthy(900)
            Path(out).write_text(json.dumps([p.url for p in procs]))
            sys.stdin.read()
        finally:
            for p in procs:
                p.stop(grace_s=0)
    elif command == "receivers":
        import multiprocessing as mp

        trainer_addr = argv[7]
        procs = [mp.get_context("spawn").Process(target=receiver_proc,
                                                 args=(k, hf_dir, trainer_addr, bucket_mb, repeats, pp))
                 for k in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    else:
        from megarl.testing.multiproc import run_ranks

        urls = json.loads(Path(argv[7]).read_text())
        result = run_ranks(trainer_rank, 2 * pp, timeout_s=3000, env=ENV,
                           args=(hf_dir, urls, addr, bucket_mb, repeats, pp))[0]
        Path(out).write_text(json.dumps(result))


def main() -> None:
    from weight_sync import make_model

    from megarl.testing.netns import emulated_hosts

    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--pp", type=int, default=1, help="trainer pipeline stages (2: 4 trainer ranks)")
    parser.add_argument("--workdir", default="/tmp/megarl_ws_hosts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = str(make_model(work, args.size_gb))
    urls_json, out_json = work / "urls.json", work / "out.json"
    urls_json.unlink(missing_ok=True)
    load_before = os.getloadavg()
    me = [sys.executable, __file__]
    common = [str(args.bucket_mb), str(args.repeats), str(args.pp)]
    with emulated_hosts(["trainer", "rollout"]) as hosts:
        rollout, trainer = hosts["rollout"], hosts["trainer"]
        engines = rollout.popen([*me, "engines", hf_dir, rollout.addr, str(urls_json), *common], stdin=subprocess.PIPE)
        try:
            while not urls_json.exists():
                assert engines.poll() is None, "the engines exited: see engine*.log"
                time.sleep(1)
            receivers = rollout.popen([*me, "receivers", hf_dir, rollout.addr, "-", *common, trainer.addr])
            done = trainer.run([*me, "trainer", hf_dir, trainer.addr, str(out_json), *common, str(urls_json)],
                               timeout=3600)
            assert done.returncode == 0, f"trainer side exited with {done.returncode}"
            receivers.wait(timeout=120)
        finally:
            engines.stdin.close()
            engines.wait(timeout=120)
    out = json.loads(out_json.read_text())
    sync_s = statistics.median(m["timing/weight_sync_s"] for m in out["sync"])
    raw_s = statistics.median(out["raw_s"])
    report = {"hf_gb": out["hf_bytes"] / 1e9, "buckets": out["buckets"], "pp": args.pp, "rounds": out["rounds"],
              "sync_s": out and [m["timing/weight_sync_s"] for m in out["sync"]],
              "raw_s": out["raw_s"], "median_sync_s": sync_s, "median_raw_s": raw_s, "ratio_over_raw": raw_s / sync_s,
              "sent_per_trainer_rank": out["sent"], "planned_sent": out["planned_sent"],
              "engine_rank_bytes_over_shard": [out["sync"][-1][f"weight_sync/engine_rank{r}_bytes_over_shard"]
                                               for r in range(2)],
              "load_before": load_before, "load_after": os.getloadavg()}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("engines", "receivers", "trainer"):
        side(sys.argv[1:])
    else:
        main()
