"""Context-parallel token layout: TE's load-balanced THD partition and the CP micro batch.

Reference: the layout documented by Transformer Engine (``thd_partition_indices_kernel``) and
Megatron-LM (``get_thd_batch_on_this_cp_rank``): every segment of the padded row is cut into
``2 * CP`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2 * CP - 1 - r``, in row order;
written here from that description, independently of the module.
"""
import pytest
import torch

from megarl.training.batch import TrainBatch
from megarl.training.batching import MicroBatchSpec
from megarl.training.context_parallel import cp_padded_length, cp_row_multiple, pack_cp_micro_batch, partition_indices


def _documented_layout(lengths, cp_size, cp_rank):
    out, start = [], 0
    for length in lengths:
        chunks = torch.arange(start, start + length).view(2 * cp_size, length // (2 * cp_size))
        out += chunks[cp_rank].tolist() + chunks[2 * cp_size - 1 - cp_rank].tolist()
        start += length
    return out


@pytest.mark.parametrize("cp_size", [2, 4])
def test_partition_matches_documented_layout_and_round_trips(cp_size):
    gen = torch.Generator().manual_seed(cp_size)
    for _ in range(20):
        real = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        lengths = [cp_padded_length(n, cp_size) for n in real]
        assert all(p % (2 * cp_size) == 0 and n <= p < n + 2 * cp_size for n, p in zip(real, lengths))
        bounds = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        total = int(bounds[-1])
        parts = [partition_indices(bounds, total, cp_size, r, use_te=False) for r in range(cp_size)]
        for r, part in enumerate(parts):
            assert part.dtype == torch.int64 and part.numel() == total // cp_size
            assert part.tolist() == _documented_layout(lengths, cp_size, r)
        # round trip: the ranks' shares are a partition of the row; scattering them back restores it
        row = torch.randn(total)
        restored = torch.empty(total)
        restored[torch.cat(parts)] = torch.cat([row[p] for p in parts])
        assert torch.equal(restored, row)
        assert sorted(torch.cat(parts).tolist()) == list(range(total))


def test_partition_rejects_indivisible_segments():
    with pytest.raises(ValueError, match="2 \\* context_parallel_size = 4"):
        partition_indices(torch.tensor([0, 6, 10]), 10, 2, 0, use_te=False)
    with pytest.raises(ValueError, match="divisible"):
        partition_indices(torch.tensor([0, 8]), 12, 2, 0, use_te=False)


def test_row_multiple():
    assert cp_row_multiple(2) == 4 and cp_row_multiple(4, 1) == 8
    assert cp_row_multiple(2, 2) == 4 and cp_row_multiple(2, 3) == 12 and cp_row_multiple(4, 16) == 64


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(lengths)).cumsum(0)
    total = int(cu[-1])
    mask = torch.ones(total, dtype=torch.bool)
    mask[cu[:-1]] = False
    return TrainBatch(input_ids=torch.randint(1, 50, (total,), generator=gen), cu_seqlens=cu, loss_mask=mask,
                      advantages=torch.randn(len(lengths), generator=gen), rollout_logprobs=torch.zeros(total))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_micro_batch_shares_reassemble_the_padded_row(cp_size):
    lengths = [5, 9, 3, 12]
    batch = _batch(lengths)
    rows = (2, 0, 3)  # sequence 1 is not in this micro batch
    padded = [cp_padded_length(lengths[i], cp_size) for i in rows]
    row_length = sum(padded) + 2 * cp_size  # a trailing padding segment too
    spec = MicroBatchSpec(rows=(rows,), row_length=row_length, num_tokens=sum(lengths[i] for i in rows))
    # the full row, built from the description: sequences end to end at padded offsets, zeros elsewhere
    full, starts, offset = torch.zeros(row_length, dtype=torch.int64), [], 0
    for i, p in zip(rows, padded):
        full[offset:offset + lengths[i]] = batch.input_ids[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]]
        starts.append(offset)
        offset += p
    reassembled = torch.full((row_length,), -1, dtype=torch.int64)
    for r in range(cp_size):
        mb = pack_cp_micro_batch(batch, spec, cp_rank=r, cp_size=cp_size)
        assert mb.input_ids.shape == (1, row_length // cp_size) and mb.shape == (1, row_length)
        assert mb.local_index.tolist() == _documented_layout(padded + [2 * cp_size], cp_size, r)
        reassembled[mb.local_index] = mb.input_ids[0]
        # the label of a local position is the next token of the FULL row, wherever it lives
        assert torch.equal(mb.labels[0], full[(mb.local_index + 1) % row_length])
        bounds = [0] + torch.tensor(padded + [2 * cp_size]).cumsum(0).tolist()
        params = mb.packed_seq_params
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert getattr(params, field).tolist() == bounds and getattr(params, field).dtype == torch.int32
        assert params.qkv_format == "thd" and params.max_seqlen_q == max(padded + [2 * cp_size])
        # real tokens: full-row positions and batch positions, as the loss code expects
        assert mb.flat_index.tolist() == [s + k for s, i in zip(starts, rows) for k in range(lengths[i])]
        assert torch.equal(mb.token_index, batch.token_index(rows))
        assert mb.cu_seqlens.tolist() == [0] + torch.tensor([lengths[i] for i in rows]).cumsum(0).tolist()
        assert torch.equal(mb.gather(batch.input_ids), full)
        assert torch.equal(mb.router_positions(), mb.local_index)
        assert torch.equal(mb.router_positions(tp_rank=1, tp_size=2, sequence_parallel=True),
                           mb.local_index[row_length // cp_size // 2:])
    assert torch.equal(reassembled, full)


def test_cp_micro_batch_rejects_a_short_row():
    batch = _batch([5, 7])
    with pytest.raises(ValueError, match="padded to multiples of 4"):
        pack_cp_micro_batch(batch, MicroBatchSpec(rows=((0, 1),), row_length=12, num_tokens=12), cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="one THD row"):
        pack_cp_micro_batch(batch, MicroBatchSpec(rows=((0,), (1,)), row_length=8, num_tokens=12), cp_rank=0, cp_size=2)


def test_padding_only_micro_batch():
    mb = pack_cp_micro_batch(_batch([5]), MicroBatchSpec(rows=((),), row_length=8, num_tokens=0), cp_rank=1, cp_size=2)
    assert mb.flat_index.numel() == 0 and mb.cu_seqlens.tolist() == [0]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 8] and mb.local_index.tolist() == [2, 3, 4, 5]
    moved = mb.to("meta")  # a device copy keeps the CP fields and moves every THD boundary
    assert type(moved) is type(mb) and moved.full_length == 8 and moved.local_index.device.type == "meta"
    assert all(getattr(moved.packed_seq_params, f).device.type == "meta"
               for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"))


@pytest.mark.parametrize("cp_size,local_multiple,policy", [(2, 1, "each"), (2, 2, "uniform"), (4, 3, "across_dp")])
def test_trainer_plan_gives_valid_cp_rows_covering_every_token_once(cp_size, local_multiple, policy):
    """The trainer's CP planning (padded lengths, `cp_row_multiple`) -> rows TE can split."""
    from megarl.training.batching import plan_micro_batches

    gen = torch.Generator().manual_seed(cp_size)
    batch = _batch(torch.randint(2, 60, (11,), generator=gen).tolist())
    plan = plan_micro_batches([cp_padded_length(n, cp_size) for n in batch.seq_lens.tolist()], dp_size=2,
                              max_tokens_per_microbatch=96, pad_multiple=cp_row_multiple(cp_size, local_multiple),
                              length_policy=policy, pack_rows=False)
    seen = torch.zeros(batch.num_tokens, dtype=torch.int64)
    for rank_plan in plan.micro_batches:
        for spec in rank_plan:
            local_tokens = set()
            for r in range(cp_size):
                mb = pack_cp_micro_batch(batch, spec, cp_rank=r, cp_size=cp_size)
                assert (mb.full_length // cp_size) % local_multiple == 0
                assert mb.input_ids.shape == (1, mb.full_length // cp_size)
                local_tokens.update(mb.local_index.tolist())
            assert local_tokens == set(range(spec.row_length))
            seen[mb.token_index] += 1
    assert bool((seen == 1).all())
