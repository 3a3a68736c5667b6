"""The converters' copy-avoiding paths agree with the general ones.

References: ``torch.load`` for the torch.save blob reader; the general conversion
(``to_megatron`` + ``split_tp`` on tensors read with ``HFCheckpointReader.get``, itself checked
head by head in test_mapping) for the direct HF reads.
"""
import io

import pytest
import torch

from megarl.conversion.fastio import StoragePool, read_hf_into, read_torch_save_tensor, row_plan
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family
from megarl.models.mapping import TPSplit, hf_names, split_tp, to_megatron


def _concrete_entries(table, layout):
    """One concrete HF name list per table entry (layer 0, expert 1)."""
    for template, entry in table.items():
        values = {k: v for k, v in (("L", 0), ("E", 1)) if "{" + k + "}" in template}
        yield template, entry, hf_names(entry, values)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture", ["tiny_moe_dir", "tiny_glm4_moe_dir"])
@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_direct_hf_reads_equal_the_general_conversion(fixture, rank, size, request):
    from megarl.training.model import load_hf_config

    hf_dir = request.getfixturevalue(fixture)
    config = load_hf_config(hf_dir)
    family = get_family(config)
    layout = family.layout(config, tp_size=size)
    reader = HFCheckpointReader(hf_dir)
    checked = 0
    for template, entry, names in _concrete_entries(family.table, layout):
        if not all(n in reader for n in names):
            continue  # e.g. a dense-layer template in an all-MoE model
        expected = split_tp(to_megatron(entry, [reader.get(n) for n in names], layout), entry.tp_split, rank, size)
        param = torch.full(expected.shape, float("nan"), dtype=expected.dtype)
        done = read_hf_into(param, reader, names, entry, layout, rank, size)
        if entry.tp_split is TPSplit.ROW and size > 1:
            assert not done and bool(torch.isnan(param).all()), template  # falls back, untouched
            continue
        assert done, template
        assert torch.equal(param, expected), template
        checked += 1
    reader.close()
    assert checked >= 6


def test_row_plan_pads_vocabulary_and_interleaves_qkv(tiny_moe_dir):
    from megarl.models.mapping import Entry, Transform
    from megarl.training.model import load_hf_config

    layout = get_family(load_hf_config(tiny_moe_dir)).layout(load_hf_config(tiny_moe_dir), tp_size=1)
    vocab = Entry(("e",), Transform.VOCAB, TPSplit.COLUMN)
    rows, runs = row_plan(vocab, layout, (layout.vocab_size,), 0, 1)
    assert rows == layout.padded_vocab_size and runs == ((0, 0, 0, layout.vocab_size),)
    qkv = Entry(("q", "k", "v"), Transform.QKV, TPSplit.COLUMN)
    hd, groups = layout.head_dim, layout.num_query_groups
    per_group = layout.num_attention_heads // groups
    _, runs = row_plan(qkv, layout, (groups * per_group * hd, groups * hd, groups * hd), 0, 1)
    # [q_g; k_g; v_g] per group g, written out
    expected, dst = [], 0
    for g in range(groups):
        for i, n in ((0, per_group * hd), (1, hd), (2, hd)):
            expected.append((i, g * n, dst, n))
            dst += n
    assert list(runs) == expected


def _blobs():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "fp32": base, "bf16": base.to(torch.bfloat16), "int64": torch.arange(5), "bool": base > 3,
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3), "3d": torch.randn(2, 3, 4),
        "transposed": base.t(), "view_of_larger": base[1:3],
    }


@pytest.mark.parametrize("stream", ["file", "bytesio"])
def test_torch_save_blob_reader_matches_torch_load(tmp_path, stream):
    import os

    path, spans = tmp_path / "blobs.bin", {}
    with open(path, "wb") as f:
        f.write(b"x" * 13)  # blobs start at arbitrary offsets, as in a DCP file
        for name, tensor in _blobs().items():
            start = f.tell()
            if stream == "file":
                torch.save(tensor, f)  # a file stream: zip records with data descriptors (DCP's case)
            else:
                buf = io.BytesIO()
                torch.save(tensor, buf)
                f.write(buf.getvalue())
            spans[name] = (start, f.tell() - start)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, (offset, length) in spans.items():
            with open(path, "rb") as f:
                f.seek(offset)
                reference = torch.load(io.BytesIO(f.read(length)), weights_only=True)
            got = read_torch_save_tensor(fd, offset, length)
            if name in ("transposed", "view_of_larger"):
                assert got is None, name  # strided / offset storage: the caller uses torch.load
                continue
            assert got is not None and got.dtype == reference.dtype and got.shape == reference.shape, name
            assert torch.equal(got, reference), name
            out = torch.empty_like(reference)
            assert read_torch_save_tensor(fd, offset, length, out=out) is out and torch.equal(out, reference)
            if reference.numel():
                wrong = torch.empty(reference.shape, dtype=torch.float64)
                assert read_torch_save_tensor(fd, offset, length, out=wrong) is None
        assert read_torch_save_tensor(fd, 0, 13) is None  # not a zip
    finally:
        os.close(fd)


def test_storage_pool_reuses_exact_storages():
    pool = StoragePool()
    a = pool.empty((4, 8), torch.float32, group=0)
    assert a.untyped_storage().nbytes() == a.nbytes and a.is_contiguous()
    ptr = a.data_ptr()
    b = pool.empty((8, 4), torch.float32, group=1)  # group 0 still holds its storage
    assert b.data_ptr() != ptr
    del a
    pool.release(0)
    c = pool.empty((8, 4), torch.float32, group=2)  # same byte size: group 0's storage
    assert c.data_ptr() == ptr and c.shape == (8, 4)
    pool.empty((3,), torch.bfloat16, group=2)
    pool.release(1)
    pool.release(2)
    pool.release(3)  # group 1's storage stayed free for a whole round: dropped
    assert sum(len(v) for v in pool._free.values()) == 0 and sum(len(v) for v in pool._idle.values()) == 2


def test_own_storage_shares_memory_and_saves_only_the_view():
    from megarl.conversion.dist_ckpt import _own_storage

    full = torch.randn(6, 5)
    gate, up = full.chunk(2)
    own = _own_storage(up)
    assert own.data_ptr() == up.data_ptr() and own.untyped_storage().nbytes() == up.nbytes
    assert torch.equal(own, up)
    small, large = io.BytesIO(), io.BytesIO()
    torch.save(own, small)
    torch.save(up, large)
    assert len(large.getvalue()) - len(small.getvalue()) >= gate.nbytes  # the view alone is written
    assert torch.equal(torch.load(io.BytesIO(small.getvalue()), weights_only=True), up)
    transposed = full.t()
    assert _own_storage(full) is full and _own_storage(transposed) is transposed


def test_model_prefix_skips_the_optimizer_copies_of_a_trainer_checkpoint():
    from megarl.conversion.dist_ckpt import model_prefix

    emb = "embedding.word_embeddings.weight"
    trainer = {k + emb: None for k in ("", "optimizer.state.param.", "optimizer.state.exp_avg.",
                                       "optimizer.state.exp_avg_sq.")}  # keys of a real trainer save
    assert model_prefix(trainer) == ""
    assert model_prefix({"model." + emb: None, "optimizer.state.exp_avg.model." + emb: None}) == "model."
    with pytest.raises(ValueError, match="cannot locate the model"):
        model_prefix({"a." + emb: None, "b." + emb: None})
