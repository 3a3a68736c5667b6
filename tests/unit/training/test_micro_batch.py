"""Packed micro-batch tensors: rows, block-diagonal causal mask, positions, orders."""
import pytest
import torch

from megarl.training.batch import TrainBatch
from megarl.training.batching import MicroBatchSpec
from megarl.training.micro_batch import pack_micro_batch


def _batch():
    lens = [4, 2, 3, 5]
    cu = torch.tensor([0, 4, 6, 9, 14])
    return TrainBatch(input_ids=torch.arange(1, 15), cu_seqlens=cu, loss_mask=torch.zeros(14),
                      advantages=torch.zeros(4), rollout_logprobs=torch.zeros(14),
                      old_logprobs=torch.arange(14.0)), lens


@pytest.mark.timeout(30)
def test_rows_mask_positions_and_gather_against_loops():
    batch, lens = _batch()
    spec = MicroBatchSpec(rows=((3,), (0, 1), ()), row_length=6, num_tokens=11)
    mb = pack_micro_batch(batch, spec)
    assert mb.shape == (3, 6)
    seq_of, pos_of = {}, {}
    for r, row in enumerate(spec.rows):
        offset = 0
        for i in row:
            start = int(batch.cu_seqlens[i])
            for t in range(lens[i]):
                assert mb.input_ids[r, offset + t] == batch.input_ids[start + t]
                seq_of[(r, offset + t)], pos_of[(r, offset + t)] = i, t
            offset += lens[i]
    for r in range(3):
        for q in range(6):
            if (r, q) in pos_of:
                assert mb.position_ids[r, q] == pos_of[(r, q)]
            for k in range(6):
                same = seq_of.get((r, q), ("pad", r)) == seq_of.get((r, k), ("pad", r))
                assert bool(mb.attention_mask[r, 0, q, k]) == (not (same and k <= q)), (r, q, k)
    # real order: sequences contiguous, mapped back to the batch
    assert mb.cu_seqlens.tolist() == [0, 5, 9, 11]
    assert torch.equal(batch.input_ids[mb.token_index], mb.input_ids.reshape(-1)[mb.flat_index])
    flat = mb.gather(batch.old_logprobs, pad_value=-1.0)
    assert torch.equal(flat[mb.flat_index], batch.old_logprobs[mb.token_index])
    assert (flat[torch.tensor([5, 12, 13, 17])] == -1).all()
    assert (flat[torch.tensor([10, 11])] != -1).all()


@pytest.mark.timeout(30)
def test_router_positions_follow_megatron_sequence_major_order():
    batch, _ = _batch()
    mb = pack_micro_batch(batch, MicroBatchSpec(rows=((3,), (0, 1)), row_length=6, num_tokens=11))
    hidden_order = torch.arange(12).view(2, 6).t()  # [S, R] like Megatron's [s, b, h]
    assert torch.equal(mb.router_positions(), hidden_order.reshape(-1))
    shards = [mb.router_positions(tp_rank=r, tp_size=2, sequence_parallel=True) for r in range(2)]
    assert torch.equal(torch.cat(shards), hidden_order.reshape(-1))
    assert torch.equal(shards[1], hidden_order[3:].reshape(-1))


@pytest.mark.timeout(30)
def test_thd_needs_one_row():
    batch, _ = _batch()
    with pytest.raises(ValueError, match="single row"):
        pack_micro_batch(batch, MicroBatchSpec(rows=((0,), (1,)), row_length=4, num_tokens=6), use_packed_seq_params=True)
