"""The driver never carries the batch: bytes of one RL step through a real Ray `TrainerGroup`.

The same global batch (R3 routes kept by engine-facing workers, as the run leaves them) is trained
at DP 1 (TP2), DP 2 and DP 4 on CPU ranks. References: pickled sizes of what crosses the driver
(`megarl.testing.driver_bytes`), the whole batch's own size, the prediction of
`megarl.launch.data_plan.plan_step_bytes`, and DP 1's loss (a second layout).
"""
import pytest
import torch

from megarl.testing.driver_bytes import step_bytes
from megarl.training.batch import TrainBatch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAYERS, TOPK, EXPERTS = 2, 2, 8  # the tiny MoE (tests/conftest.py)
NUM_SEQS, GLOBAL_BATCH = 64, 32  # two optimizer steps per RL step


def _batch_and_routes(vocab_size: int) -> tuple[TrainBatch, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(40, 120, (NUM_SEQS,), generator=gen)  # shards >> their pickle framing
    cu = torch.zeros(NUM_SEQS + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    mask = torch.ones(total, dtype=torch.bool)
    mask[cu[:-1]] = False
    mask[cu[:-1] + 1] = False  # a two-token prompt
    batch = TrainBatch(input_ids=torch.randint(0, vocab_size, (total,), generator=gen), cu_seqlens=cu,
                       loss_mask=mask, advantages=torch.randn(NUM_SEQS, generator=gen),
                       rollout_logprobs=torch.where(mask, -2.0, 0.0))
    routes = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(int(n) * LAYERS)])
              .reshape(int(n), LAYERS, TOPK).to(torch.int32) for n in lens]
    return batch, routes


def _cfg(hf_dir, world: int, tp: int):
    from megarl.config.loader import load_config

    return load_config(None, [
        f"model.hf_path={hf_dir}", "cluster.device=cpu", "cluster.trainer_nodes=1",
        f"cluster.trainer_devices_per_node={world}", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.sequence_parallel={str(tp > 1).lower()}", "rollout.num_engines=0", "train.precision=fp32",
        "train.routing_replay=r3", f"train.global_batch_size={GLOBAL_BATCH}", "train.max_tokens_per_microbatch=1024",
        "algorithm.clip_low=0.9", "algorithm.clip_high=10.0", "rollout.num_prompts_per_step=8",
        "rollout.group_size=8"])


def test_driver_receives_metrics_only_and_each_rank_its_share(tiny_moe_dir):
    import ray
    from transformers import AutoConfig

    from megarl.cluster.bundles import bundle_shapes
    from megarl.cluster.placement import build_placement, init_ray
    from megarl.launch.data_plan import METRICS_BYTES, plan_step_bytes
    from megarl.launch.trainer_group import TrainerGroup

    batch, routes = _batch_and_routes(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size)
    results = {}
    started = init_ray(_cfg(tiny_moe_dir, 4, 1), cuda=False)  # cluster.device=cpu
    try:
        for world, tp in ((2, 2), (2, 1), (4, 1)):  # DP 1 (the two TP ranks share one shard), DP 2, DP 4
            cfg = _cfg(tiny_moe_dir, world, tp)
            placement = build_placement(cfg, bundle_shapes(cfg))
            group = TrainerGroup(cfg, placement)
            try:
                assert group.dp_size == world // tp
                # the routes kept by one engine-facing worker per data-parallel rank (as many engines)
                results[group.dp_size] = (*step_bytes(group, batch, routes, global_batch_size=GLOBAL_BATCH,
                                                      route_workers=group.dp_size), cfg)
            finally:
                group.shutdown()
                ray.util.remove_placement_group(placement.trainer_pg)
    finally:
        if started:
            ray.shutdown()
    whole = results[1][0]["baseline_rank_received"]
    ref_metrics = results[1][1]
    for dp, (counted, metrics, cfg) in results.items():
        world = cfg.cluster.trainer_devices_per_node
        calls = 1 + len(metrics)  # prepare + one train_step per optimizer step
        # metrics only: a batch-independent bound per rank and call
        assert counted["driver_received"] <= world * calls * METRICS_BYTES, dp
        assert counted["driver_received"] < counted["baseline_driver_received"] / 4, dp
        # the shards together are the batch (plus per-shard framing), each about a 1/DP share
        ranks = counted["rank_received"]
        assert len(ranks) == dp
        assert sum(ranks) == pytest.approx(whole, rel=0.15), dp
        for share in ranks:
            assert share == pytest.approx(whole / dp, rel=0.25), (dp, ranks)
        # R3 routes: no process holds more than one shard's worth (driver: none; each engine-facing
        # worker its engine's share; each rank its shard's)
        route_total = sum(r.nbytes for r in routes)
        holders = counted["rank_route_bytes"] + counted["route_worker_bytes"]
        assert sum(counted["rank_route_bytes"]) == sum(counted["route_worker_bytes"]) == route_total, dp
        assert max(holders) <= 1.25 * route_total / dp, (dp, holders)
        print(f"DP {dp}: R3 route bytes per rank {counted['rank_route_bytes']}, per engine-facing worker "
              f"{counted['route_worker_bytes']} of {route_total}; driver received {counted['driver_received']} B")
        # the prediction from config + config.json, at this batch's mean length
        plan = plan_step_bytes(cfg, {"num_hidden_layers": LAYERS, "num_experts_per_tok": TOPK},
                               mean_seq_tokens=batch.num_tokens / batch.num_sequences)
        assert plan.rank_received_bytes == pytest.approx(sum(ranks) / dp, rel=0.25), dp
        assert counted["driver_received"] <= plan.driver_received_bytes
        # the same loss and gradient as DP 1: the data path changes nothing else
        for step, ref in zip(metrics, ref_metrics):
            assert step["loss/policy"] == pytest.approx(ref["loss/policy"], rel=1e-4, abs=1e-6), dp
            assert step["optim/grad_norm"] == pytest.approx(ref["optim/grad_norm"], rel=1e-4), dp
            assert step["batch/num_tokens"] == ref["batch/num_tokens"]
