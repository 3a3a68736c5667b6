"""Dynamic batching: Karmarkar-Karp balance, token budgets, equal micro-batch counts, packed rows."""
import itertools
import random

import pytest

from megarl.training.batching import karmarkar_karp, plan_micro_batches


def _best_spread(weights, k):
    best = None
    for assign in itertools.product(range(k), repeat=len(weights)):
        sums = [0] * k
        for w, a in zip(weights, assign):
            sums[a] += w
        spread = max(sums) - min(sums)
        best = spread if best is None else min(best, spread)
    return best


@pytest.mark.timeout(60)
def test_karmarkar_karp_is_a_partition_and_near_optimal():
    rng = random.Random(0)
    for _ in range(30):
        k = rng.choice([2, 3])
        weights = [rng.randint(1, 50) for _ in range(rng.randint(1, 7))]
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(len(weights)))
        sums = [sum(weights[i] for i in p) for p in parts]
        # KK is a heuristic; on these sizes it stays within the largest item of the optimum
        assert max(sums) - min(sums) <= _best_spread(weights, k) + max(weights)
    assert karmarkar_karp([5, 5, 4, 3, 3], 2) in ([[0, 2], [1, 3, 4]], [[1, 2], [0, 3, 4]], [[0, 3, 4], [1, 2]])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pack_rows", [True, False])
def test_plan_respects_budget_and_equal_microbatch_counts(pack_rows):
    rng = random.Random(1)
    lens = [rng.randint(20, 300) for _ in range(37)]
    plan = plan_micro_batches(lens, dp_size=2, max_tokens_per_microbatch=600, pad_multiple=4, pack_rows=pack_rows)
    seen = [i for rank in plan.micro_batches for mb in rank for i in mb.seq_indices]
    assert sorted(seen) == list(range(37))
    assert len({len(rank) for rank in plan.micro_batches}) == 1
    for rank in plan.micro_batches:
        for mb in rank:
            assert mb.num_tokens == sum(lens[i] for i in mb.seq_indices)
            assert mb.num_tokens <= 600 or len(mb.seq_indices) == 1
            assert mb.row_length % 4 == 0
            for row in mb.rows:
                assert sum(lens[i] for i in row) <= mb.row_length
            fullest = max(sum(lens[i] for i in row) for row in mb.rows)
            assert mb.row_length == -(-fullest // 4) * 4, "rows are no longer than their fullest one"
            if not pack_rows:
                assert len(mb.rows) == 1
    rank_tokens = [sum(mb.num_tokens for mb in rank) for rank in plan.micro_batches]
    assert abs(rank_tokens[0] - rank_tokens[1]) <= max(lens)
    run = sum(len(mb.rows) * mb.row_length for rank in plan.micro_batches for mb in rank)
    assert plan.padding_fraction == pytest.approx((run - sum(lens)) / run)
    assert plan.padding_fraction < (0.1 if pack_rows else 0.02)


@pytest.mark.timeout(60)
def test_plan_policies_and_padding_only_microbatches():
    lens = [500, 10, 10]  # rank 0 gets the long one (1 mb), rank 1 the two short ones
    plan = plan_micro_batches(lens, dp_size=2, max_tokens_per_microbatch=12, length_policy="across_dp")
    assert plan.num_microbatches == 2
    shapes = [[(len(mb.rows), mb.row_length) for mb in rank] for rank in plan.micro_batches]
    assert shapes[0] == shapes[1]
    assert any(not mb.seq_indices for rank in plan.micro_batches for mb in rank)  # padding only
    uniform = plan_micro_batches([50, 40, 9, 8, 7], dp_size=1, max_tokens_per_microbatch=60, length_policy="uniform")
    assert len({(len(mb.rows), mb.row_length) for mb in uniform.micro_batches[0]}) == 1
    multiple = plan_micro_batches([30, 20, 10, 9, 8], dp_size=1, max_tokens_per_microbatch=30, microbatch_multiple=4)
    assert multiple.num_microbatches == 4 and sorted(i for mb in multiple.micro_batches[0] for i in mb.seq_indices) == list(range(5))
    fixed = plan_micro_batches([3, 4, 5, 6, 7], dp_size=1, max_tokens_per_microbatch=None, micro_batch_size=2)
    assert [len(mb.seq_indices) for mb in fixed.micro_batches[0]] == [2, 2, 1]
    with pytest.raises(ValueError, match="data-parallel"):
        plan_micro_batches([3], dp_size=2, max_tokens_per_microbatch=10)
