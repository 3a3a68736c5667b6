"""How the parallel HF export splits its work (`megarl.conversion.parallel_export`), on paper.

References: the single-rank export's own plan (``hf_io.plan_shards`` / ``shard_file_names`` over
every tensor), the tensors' bytes summed here, and the index file read back as JSON."""
import json
import random

import pytest
import torch

from megarl.conversion import hf_io
from megarl.conversion.parallel_export import RankExport, plan_rank_exports, split_groups, write_merged_index


def _groups(seed: int, num_groups: int) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [[(f"g{g}.t{t}", rng.choice([torch.float32, torch.bfloat16]), (rng.randint(1, 64), 32))
             for t in range(rng.randint(1, 4))] for g in range(num_groups)]


def _bytes(entries) -> int:
    return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in entries)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_each_rank_gets_consecutive_groups_and_about_an_even_share(seed, world_size):
    groups = _groups(seed, 12)
    sizes = [_bytes(g) for g in groups]
    owners = split_groups(sizes, world_size)
    assert owners == sorted(owners) and set(owners) <= set(range(world_size))
    for rank in range(world_size):
        share = sum(s for s, o in zip(sizes, owners) if o == rank)
        assert abs(share - sum(sizes) / world_size) <= max(sizes), (rank, share)


@pytest.mark.parametrize("world_size", [1, 2, 5, 20])
def test_the_ranks_write_every_tensor_once_in_order_under_global_names(world_size):
    groups = _groups(0, 10)
    flat = [e for g in groups for e in g]
    max_shard = 3 * 64 * 32 * 4
    parts = plan_rank_exports(groups, world_size, max_shard)
    assert len(parts) == world_size
    assert [e for p in parts for shard in p.shards for e in shard] == flat
    files = [f for p in parts for f in p.files]
    assert files == hf_io.shard_file_names(len(files))  # one numbering: model-i-of-N
    assert [g for p in parts for g in p.groups] == list(range(len(groups)))
    for part in parts:  # a rank's shards hold exactly its groups' tensors, none over the limit alone
        assert [e for s in part.shards for e in s] == [e for g in part.groups for e in groups[g]]
        assert all(_bytes(s) <= max_shard or len(s) == 1 for s in part.shards)
    if world_size == 1:  # the single-rank export's plan, file for file
        assert [list(s) for s in parts[0].shards] == hf_io.plan_shards(flat, max_shard)


def test_the_merged_index_covers_every_rank_and_refuses_overlap(tmp_path):
    groups = _groups(1, 6)
    parts = plan_rank_exports(groups, 3, 2 * 64 * 32 * 4)
    write_merged_index(tmp_path, parts)
    index = json.loads((tmp_path / hf_io.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(_bytes(g) for g in groups)
    assert index["weight_map"] == {n: f for p in parts for f, s in zip(p.files, p.shards) for n, _, _ in s}
    twice = [parts[0], RankExport(parts[1].groups, parts[0].files, parts[1].shards)]
    with pytest.raises(ValueError, match="overlap"):
        write_merged_index(tmp_path, twice)


def test_split_refuses_no_ranks():
    with pytest.raises(ValueError, match="world_size=0"):
        split_groups([1, 2], 0)


def test_ranks_are_cut_to_what_host_memory_holds():
    """Each rank holds two groups and a cast copy: 3 x total / layers bytes."""
    from megarl.conversion.parallel_export import available_memory_bytes, ranks_within_memory

    layer = 22 * 10**9  # a DeepSeek-V3 MoE layer in bf16
    total, layers = 61 * layer, 61
    assert 2 * 10**12 // (3 * layer) == 30 and ranks_within_memory(total, layers, 2 * 10**12, 8) == 8
    assert ranks_within_memory(total, layers, 200 * 10**9, 8) == 200 * 10**9 // (3 * layer) == 3
    assert ranks_within_memory(total, layers, 10 * 10**9, 8) == 1  # never none
    assert 0 < available_memory_bytes() <= 2**60
