"""The p2p transport's wire format: tickets, checksums (against independent references) and the
receiver's per-tensor checks (name, dtype, shape, bytes) before anything is loaded."""
from __future__ import annotations

import base64
import zlib

import pytest
import torch
import xxhash

from megarl.weight_sync import receiver, wire


def test_ticket_round_trips_through_a_name_and_plain_pickle_that_sglang_accepts():
    from sglang.srt.utils.common import MultiprocessingSerializer

    ticket = {"op": "bucket", "bucket": 3, "tensors": [["model.norm.weight", "float32", [8], "00"]]}
    (name, tensor), = MultiprocessingSerializer.deserialize(wire.payload(ticket))  # SGLang's SafeUnpickler
    assert wire.decode_ticket(name) == ticket and tensor.numel() == 0
    assert b"torch-shm" not in base64.b64decode(wire.payload(ticket))  # nothing host-local: crosses hosts
    with pytest.raises(ValueError, match="not a megarl p2p ticket"):
        wire.decode_ticket("model.norm.weight")


def test_checksums_match_independent_references_and_see_one_flipped_byte():
    # Seeded: sum64 misses a swap of two elements whose bytes sum to the same value (~0.3% of
    # random pairs); the seeded pair differs.
    data = torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    raw = data.numpy().tobytes()
    assert wire.checksum(data, "crc32") == f"{zlib.crc32(raw):08x}"
    assert wire.checksum(torch.empty(0), "xxh3") == "2d06800538d394c2"  # XXH3_64bits("") in the xxHash spec
    assert wire.checksum(data, "xxh3") == xxhash.xxh3_64_hexdigest(raw)  # the tensor's bytes in memory order
    expected_sum = sum(raw) % 2**64
    expected_weighted = sum((i + 1) * b for i, b in enumerate(raw)) % 2**64
    assert wire.checksum(data, "sum64") == f"{expected_sum:016x}{expected_weighted:016x}"
    flipped = data.clone()
    flipped.view(torch.uint8)[1234] ^= 1
    swapped = data.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    for algo in ("xxh3", "crc32", "sum64"):
        assert wire.checksum(flipped, algo) != wire.checksum(data, algo)
        assert wire.checksum(swapped, algo) != wire.checksum(data, algo)
    with pytest.raises(ValueError, match="unknown checksum"):
        wire.checksum(data, "md5")


def test_checksum_message_round_trips_every_algorithm():
    """The checksums that follow a rank's bytes: one uint8 message, each digest at its fixed width."""
    data = [torch.randn(n) for n in (1, 7, 1000)]
    for algo, width in wire.DIGEST_CHARS.items():
        sums = [wire.checksum(t, algo) for t in data]
        assert all(len(s) == width for s in sums)  # the receiver sizes its message by the width
        message = wire.encode_sums(sums, torch.device("cpu"))
        assert message.dtype == torch.uint8 and message.numel() == width * len(data)
        assert wire.decode_sums(message, algo) == sums
    assert wire.encode_sums([], torch.device("cpu")).numel() == 0
    with pytest.raises(ValueError, match="unknown checksum"):
        wire.decode_sums(message, "md5")


def _bucket(tensors, algo="xxh3"):
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors])
    listing = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), wire.checksum(t, algo)] for n, t in tensors]
    return flat, {"bucket": 0, "algo": algo, "tensors": listing}


MANIFEST = {"model.layers.0.self_attn.q_proj.weight": ((8, 4), "float32"), "model.norm.weight": ((4,), "float32")}


@pytest.mark.parametrize("mutate, status", [
    (None, 0),
    (lambda flat, t: flat.__setitem__(5, flat[5] ^ 0x10), 1),                        # a flipped byte
    (lambda flat, t: t["tensors"][1].__setitem__(0, "model.norm.weigth"), 2),        # unknown name
    (lambda flat, t: t["tensors"][0].__setitem__(2, [3, 4]), 3),                     # 3 rows: not a shard of 8
    (lambda flat, t: t["tensors"][1].__setitem__(1, "bfloat16"), 4),                 # dtype
])
def test_receiver_check_refuses_and_names_the_tensor(monkeypatch, mutate, status):
    monkeypatch.setattr(receiver, "_manifest", lambda: MANIFEST)
    q = torch.randn(4, 4)  # a TP2 rank's rows of q_proj
    norm = torch.randn(4)
    flat, ticket = _bucket([("model.layers.0.self_attn.q_proj.weight", q), ("model.norm.weight", norm)])
    if mutate is not None:
        mutate(flat, ticket)
    got, index, views = receiver._check(flat, ticket)
    assert got == status
    if status == 0:
        assert torch.equal(views[0][1], q) and torch.equal(views[1][1], norm)
    else:
        assert views == [] and index == (0 if status in (1, 3) else 1)


def test_receiver_check_refuses_a_short_or_long_message(monkeypatch):
    monkeypatch.setattr(receiver, "_manifest", lambda: MANIFEST)
    flat, ticket = _bucket([("model.norm.weight", torch.randn(4))])
    assert receiver._check(torch.cat([flat, flat[:4]]), ticket)[0] == 5
    assert receiver._check(flat[:8], ticket)[0] == 5
