"""`shard_batch`: each data-parallel rank's shard is exactly its part of the micro-batch plan.

References: `plan_micro_batches` (the planner the trainer runs on every rank), consecutive
mini-batches of ``train.global_batch_size`` sequences, and `TrainBatch.select` of the whole batch.
"""
import pytest
import torch

from megarl.training.batch import TrainBatch
from megarl.training.batching import plan_micro_batches
from megarl.training.shard import shard_batch, with_routes


def _batch(num_seqs: int, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 30, (num_seqs,), generator=gen)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    mask = torch.rand(total, generator=gen) > 0.3
    mask[cu[:-1]] = False
    return TrainBatch(input_ids=torch.randint(0, 100, (total,), generator=gen), cu_seqlens=cu, loss_mask=mask,
                      advantages=torch.randn(num_seqs, generator=gen), rollout_logprobs=torch.randn(total, generator=gen),
                      rewards=torch.rand(num_seqs, generator=gen))


@pytest.mark.parametrize("dp_size,global_batch_size", [(1, 20), (2, 20), (4, 8), (3, 7)])
def test_each_rank_gets_the_sequences_the_planner_gives_it(dp_size, global_batch_size):
    batch = _batch(20)
    shards = shard_batch(batch, dp_size=dp_size, global_batch_size=global_batch_size)
    assert [s.dp_rank for s in shards] == list(range(dp_size))
    lens = batch.seq_lens.tolist()
    for m, start in enumerate(range(0, 20, global_batch_size)):
        mini = list(range(start, min(start + global_batch_size, 20)))
        plan = plan_micro_batches([lens[i] for i in mini], dp_size=dp_size, max_tokens_per_microbatch=40)
        for shard in shards:
            assert shard.mini_seq_lens[m] == [lens[i] for i in mini]
            planned = sorted(i for spec in plan.micro_batches[shard.dp_rank] for i in spec.seq_indices)
            assert shard.mini_seq_indices[m] == planned
            expected = batch.select([mini[i] for i in planned])
            got = shard.mini(m)
            for field in ("input_ids", "cu_seqlens", "loss_mask", "advantages", "rollout_logprobs", "rewards"):
                assert torch.equal(getattr(got, field), getattr(expected, field)), field
    # every sequence goes to exactly one rank
    assert sum(s.batch.num_sequences for s in shards) == 20
    assert sum(s.batch.num_tokens for s in shards) == batch.num_tokens


def test_routes_follow_their_sequences_and_are_packed_on_the_rank():
    batch = _batch(9, seed=1)
    lens = batch.seq_lens.tolist()
    routes = [torch.randint(0, 8, (n, 2, 2), dtype=torch.int32) for n in lens]
    routes[4] = None  # a trajectory that never reached an engine routes freely
    shards = shard_batch(batch, dp_size=2, global_batch_size=9, route_refs=routes)
    for shard in shards:
        picked = [i for i in shard.mini_seq_indices[0]]
        packed = with_routes(shard, shard.route_refs).batch.routed_experts
        expected = torch.cat([routes[i] if routes[i] is not None else torch.full((lens[i], 2, 2), -1, dtype=torch.int32)
                              for i in picked])
        assert torch.equal(packed, expected)


def test_bad_shapes_are_refused():
    batch = _batch(3)
    with pytest.raises(ValueError, match="cannot be split over 4"):
        shard_batch(batch, dp_size=4, global_batch_size=3)
    with pytest.raises(ValueError, match="global_batch_size"):
        shard_batch(batch, dp_size=1, global_batch_size=0)
    shard = shard_batch(batch, dp_size=1, global_batch_size=3)[0]
    with pytest.raises(ValueError, match="routed_experts"):
        with_routes(shard, [torch.zeros(1, 2, 2, dtype=torch.int32)] * 3)
