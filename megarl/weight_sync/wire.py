"""What the checked transports put on the wire, shared by the sender and the engine-side receiver.

``p2p`` (below); the checked ``distributed`` transport sends the same tickets with ``"mode":
"broadcast"``, whole tensors, and the whole bucket as one broadcast to every engine rank.

Per bucket and engine rank, the sender lays that rank's slices of the bucket's HF tensors back to
back (the bucket's wire order, decreasing element size, so every view is aligned) and sends them
as ``uint8`` messages over the stage's process group. The control message that tells the rank
what to expect travels as the *name* of the only entry of its ``/update_weights_from_tensor``
payload (the tensor is empty, pickled by value: no shared memory, so it crosses hosts). One
ticket per sync and stage lists every bucket of the stage (the sender makes it from the plan
before the first bucket is packed)::

    megarl.p2p/{"op": "stage", "mode": "p2p", "group": ..., "algo": "xxh3", "proof": true,
                "buckets": [{"bucket": 3, "nbytes": 1048576, "tensors": [[hf_name, dtype, shape], ...],
                             "source": 1, "messages": [524288, 524288]}, ...]}

``proof`` (default true): the receiver reads each loaded ``p2p`` bucket back from the engine's
parameters (:mod:`megarl.weight_sync.load_proof`, ``weight_sync.load_proof``). ``source``
(default 0): the group rank that sends this engine rank's bytes of the bucket (segment
senders, :class:`megarl.weight_sync.segments.SegmentOwners`); ``messages`` (default one of
``nbytes``): the byte counts of the messages those bytes arrive in, back to back (slices sent from
the trainer's parameters travel as messages of their own).

With owner senders (``weight_sync.senders: owner``, :mod:`megarl.weight_sync.owners`) each engine
gets its own ticket, and a bucket entry has ``parts`` in place of ``source`` / ``messages``:
``[[source group rank, tensor index, axis, offset, shape], ...]`` in arrival order (each source's
parts in its order, then that source's checksums, one per part).

The checksums follow each bucket's bytes over the group, one more message per rank
(:func:`encode_sums`: the hex digests back to back, ``uint8`` on the group's device), so the
ticket can leave before any bucket is packed and checksummed. After the last bucket the receiver
loads it and joins the ``finish`` vote itself, without another request.

Checksums are per tensor (so a mismatch names the tensor): ``xxh3`` (the 64-bit XXH3 hash of the
``xxhash`` package, ~26 GB/s on one core here against ~3.9 GB/s for zlib's ``crc32``, which is
still accepted) for CPU buffers and ``sum64`` for CUDA buffers (computed where the bytes are).
``sum64`` of bytes ``x_0 .. x_{n-1}``
is the pair ``(sum x_i, sum (i + 1) x_i) mod 2**64``: a changed byte changes the first sum, a
moved byte the second; it is an integrity check against corruption and misplacement, not a
cryptographic hash.
"""
from __future__ import annotations

import json
import zlib
from typing import Any

import torch

TICKET_PREFIX = "megarl.p2p/"
_SUM64_CHUNK = 1 << 24
"""Bytes per chunk of ``sum64``: ``255 * 2**24 * 2**24 < 2**63``, so no partial sum overflows."""
_MASK64 = (1 << 64) - 1


def encode_ticket(ticket: dict[str, Any]) -> str:
    """The payload entry name carrying ``ticket``."""
    return TICKET_PREFIX + json.dumps(ticket, separators=(",", ":"))


def decode_ticket(name: str) -> dict[str, Any]:
    """The ticket in a payload entry name.

    Raises:
        ValueError: ``name`` is not a p2p ticket.
    """
    if not name.startswith(TICKET_PREFIX):
        raise ValueError(f"not a megarl p2p ticket: {name[:80]!r}")
    return json.loads(name[len(TICKET_PREFIX):])


def checksum_algo(device: torch.device) -> str:
    """The checksum computed where the bytes live: ``xxh3`` on CPU, ``sum64`` elsewhere."""
    return "xxh3" if device.type == "cpu" else "sum64"


def checksum(data: torch.Tensor, algo: str) -> str:
    """Checksum of a tensor's bytes.

    Args:
        data: any contiguous tensor (its bytes in memory order are checked).
        algo: ``xxh3``, ``crc32`` or ``sum64`` (see module docstring).

    Returns:
        Hex string.

    Raises:
        ValueError: unknown ``algo``.
    """
    raw = (data.detach().contiguous().view(-1).view(torch.uint8) if data.numel()
           else data.new_empty(0, dtype=torch.uint8))
    if algo == "xxh3":
        import xxhash

        return xxhash.xxh3_64_hexdigest(raw.cpu().numpy().data)  # .data: the array's buffer, no copy
    if algo == "crc32":
        return f"{zlib.crc32(raw.cpu().numpy().data):08x}"
    if algo == "sum64":
        return _sum64(raw)
    raise ValueError(f"unknown checksum algorithm {algo!r} (xxh3, crc32, sum64)")


def _sum64(raw: torch.Tensor) -> str:
    weights = None
    total, weighted = 0, 0
    for start in range(0, raw.numel(), _SUM64_CHUNK):
        chunk = raw[start:start + _SUM64_CHUNK].to(torch.int64)
        if weights is None or weights.numel() < chunk.numel():
            weights = torch.arange(1, chunk.numel() + 1, dtype=torch.int64, device=raw.device)
        part = int(chunk.sum())
        total += part
        weighted += int((chunk * weights[:chunk.numel()]).sum()) + start * part
    return f"{total & _MASK64:016x}{weighted & _MASK64:016x}"


DIGEST_CHARS = {"xxh3": 16, "crc32": 8, "sum64": 32}
"""Hex characters of one checksum per algorithm (the in-band checksum message's stride)."""


def encode_sums(sums: list[str], device: torch.device) -> torch.Tensor:
    """``[len(sums) * DIGEST_CHARS[algo]]`` uint8 on ``device`` (the group's): the hex checksums of
    one rank's tensors back to back, sent after its bytes."""
    raw = "".join(sums).encode("ascii")
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def decode_sums(message: torch.Tensor, algo: str) -> list[str]:
    """The checksums in an :func:`encode_sums` message (any device).

    Raises:
        ValueError: unknown ``algo``.
    """
    if algo not in DIGEST_CHARS:
        raise ValueError(f"unknown checksum algorithm {algo!r} (xxh3, crc32, sum64)")
    text, width = message.cpu().numpy().tobytes().decode("ascii"), DIGEST_CHARS[algo]
    return [text[i:i + width] for i in range(0, len(text), width)]


def payload(ticket: dict[str, Any]) -> str:
    """One rank's ``serialized_named_tensors`` entry holding only ``ticket``.

    A plain pickle (not SGLang's ForkingPickler, which would put even an empty CPU tensor in a
    shared-memory file of this host): SGLang's ``SafeUnpickler`` accepts it on any host.
    """
    import base64
    import pickle

    return base64.b64encode(pickle.dumps([(encode_ticket(ticket), torch.empty(0, dtype=torch.uint8))])).decode("ascii")


VOTE_FIELDS = 4
"""One row per group rank in a vote: ``(status, tensor index, bytes received, bucket index)``."""
STATUS = {0: "ok", 1: "checksum mismatch (corrupted on the wire)", 2: "name unknown to the engine's checkpoint",
          3: "shape does not fit the engine checkpoint's tensor (p2p: a shard of it; distributed: equal)",
          4: "dtype differs from the engine's checkpoint",
          5: "byte count differs from its tensors'", 6: "receiver error (see the engine's log)",
          7: "loading failed on the engine (see the engine's log)",
          8: "the sender stopped mid-stage (a bucket of zeros released the receivers; its own error is raised)",
          9: "loaded, but in none of the engine's parameters afterwards: SGLang's loader dropped it "
             "(a group its loader needs in one call split? megarl.models.families Family.engine_load_groups)"}
"""Status codes the receiver reports (the sender turns them into a :class:`WeightSyncError`)."""
