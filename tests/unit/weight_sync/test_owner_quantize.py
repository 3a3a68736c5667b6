"""Owner senders quantise their own rows of a block-FP8 weight: with the straddled blocks' amax
shared between neighbours, the bytes equal ``quantize_blockwise`` of the gathered weight."""
import pytest
import torch

from megarl.models.fp8_blocks import quantize_blockwise
from megarl.weight_sync.quantizer import quantize_rows, rows_amax


@pytest.mark.parametrize("rows, shard", [(1536, 192), (576, 72), (1024, 256), (300, 100)])
def test_owner_rows_quantise_as_the_whole_weight(rows, shard):
    """MLA's q_a_proj (1536 / TP8 = 192 rows), kv_a_proj_with_mqa (576 / 8 = 72: shards inside one
    block), an aligned split (256) and a ragged last block (300 rows)."""
    torch.manual_seed(0)
    w = (torch.randn(rows, 200) * torch.logspace(1, -3, rows)[:, None]).to(torch.bfloat16)
    block = (128, 128)
    q_ref, s_ref = quantize_blockwise(w, block)
    starts = list(range(0, rows, shard))
    parts = [rows_amax(w[a:a + shard], a, block) for a in starts]
    amax = torch.zeros_like(s_ref)
    for a, p in zip(starts, parts):  # what the neighbours exchange: the max of their parts per block
        amax[a // 128:a // 128 + p.shape[0]] = torch.maximum(amax[a // 128:a // 128 + p.shape[0]], p)
    for a in starts:
        first = a // 128
        mine = amax[first:(min(a + shard, rows) - 1) // 128 + 1]
        q, s = quantize_rows(w[a:a + shard], a, block, mine)
        assert torch.equal(q.view(torch.uint8), q_ref[a:a + shard].view(torch.uint8))
        assert torch.equal(s, s_ref[first:first + s.shape[0]])
    # without the exchange a straddled block's scale differs (magnitudes fall with the row: the
    # neighbour above holds the larger part)
    if shard % 128:
        alone = quantize_rows(w[shard:2 * shard], shard, block, parts[1])[1]
        assert not torch.equal(alone, s_ref[shard // 128:shard // 128 + alone.shape[0]])


@pytest.mark.parametrize("cols, shard", [(256, 128), (384, 96)])
def test_owner_columns_quantise_as_the_whole_weight_through_the_transpose(cols, shard):
    """A row-parallel shard (o_proj, down_proj: trainer TP splits columns) is the transposed case:
    its columns are rows of ``w.T`` with the block ``(bk, bn)``; aligned (128) and straddling (96)."""
    torch.manual_seed(1)
    w = (torch.randn(200, cols) * torch.logspace(1, -3, cols)[None, :]).to(torch.bfloat16)
    q_ref, s_ref = quantize_blockwise(w, (128, 128))
    starts = list(range(0, cols, shard))
    amax = torch.zeros_like(s_ref.T)
    for a in starts:
        p = rows_amax(w[:, a:a + shard].T, a, (128, 128))
        amax[a // 128:a // 128 + p.shape[0]] = torch.maximum(amax[a // 128:a // 128 + p.shape[0]], p)
    for a in starts:
        first = a // 128
        mine = amax[first:(min(a + shard, cols) - 1) // 128 + 1]
        q, s = quantize_rows(w[:, a:a + shard].T, a, (128, 128), mine)
        assert torch.equal(q.T.contiguous().view(torch.uint8), q_ref[:, a:a + shard].contiguous().view(torch.uint8))
        assert torch.equal(s.T, s_ref[:, first:first + s.shape[0]])
