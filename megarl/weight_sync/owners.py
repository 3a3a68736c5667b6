"""Owner senders, for real: the parts of every engine rank's slices, who sends each, and the bytes.

``weight_sync.senders: owner`` (``p2p``, engines not serving block FP8). Every trainer rank of a
stage is a sender in that stage's group (the stage sender first, then the other ranks of the
stage ascending: :meth:`OwnerParts.senders`). Each engine rank's slice of an HF tensor is filled
by the placement's pieces (:mod:`megarl.weight_sync.copy_instructions`); the part of a piece inside the
slice (:func:`~megarl.weight_sync.senders.owner_part`) leaves the trainer rank that
:func:`~megarl.weight_sync.senders.assign_senders` chose among the ranks holding that shard (an
expert from its EP owner, a TP shard from that TP rank of one dense copy, a replicated tensor from
the least-loaded holder; copies split the engines). No rank gathers, no rank sends bytes it does
not hold: each rank's outgoing bytes are ``assign_senders(...).sent[rank]``.

On the wire (:mod:`megarl.weight_sync.wire`, the ``parts`` of a bucket entry): each engine rank's
ticket lists its slices (names, dtypes, shapes, as with one sender) and its parts in the order they
arrive, ``[source group rank, tensor index, axis, offset, shape]``; each source sends its parts for
that rank in that order (each part's bytes contiguous, in the tensor's dtype), then one checksum
per part. The receiver places each part at ``offset`` along ``axis`` of its slice (a part that is
contiguous there is received in place; a column part is strided and is copied from a temporary)
and checks every part's checksum before the vote (:func:`megarl.weight_sync.receiver.place_parts`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.sync_transports import transport_entry
from megarl.weight_sync.copy_instructions import Piece, Placement
from megarl.weight_sync.engine_slices import TensorSlice
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.senders import OwnerSends, assign_senders, owner_part
from megarl.weight_sync.specs import torch_dtype

SENDERS = ("owner", "segment", "stage")
"""``weight_sync.senders``: ``owner`` (this module), ``segment`` (each engine rank's segment
assembled by the trainer rank holding most of it, :class:`~megarl.weight_sync.segments.SegmentOwners`),
``stage`` (the stage sender gathers and sends everything)."""


@dataclass(frozen=True)
class Part:
    """One part of an engine rank's slice of an HF tensor and the trainer rank sending it.

    ``tensor``: index in the engine rank's listing of the bucket (its slices, wire order);
    ``name``: the Megatron parameter; ``shard``: its shard index (``ShardSource.shard_index``);
    ``piece``: the placement piece; ``sender``: global trainer rank; ``axis`` / ``offset``: where
    the part sits in the slice (the whole slice along the other axes); ``shape``: the part's shape;
    ``dtype``: the HF tensor's; ``slice``: the engine rank's slice of the HF tensor.
    """

    tensor: int
    name: str
    shard: int
    piece: Piece
    sender: int
    axis: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    slice: TensorSlice

    @property
    def nbytes(self) -> int:
        """The part's size on the wire (bytes)."""
        return torch.Size(self.shape).numel() * torch_dtype(self.dtype).itemsize


def check_senders(senders: str, *, transport: str, quantized: bool) -> None:
    """``weight_sync.senders`` against the transport and the served checkpoint.

    Raises:
        WeightSyncError: an unknown value; ``owner`` with a transport whose registry entry does not
            declare ``owner_senders`` (``p2p`` does; ``auto`` is refused too), or with
            engines serving block FP8 (each holder quantising its own rows is on paper only:
            :func:`megarl.weight_sync.senders.unaligned_parts`).
    """
    if senders not in SENDERS:
        raise WeightSyncError(f"weight_sync.senders must be one of {' | '.join(SENDERS)}, got {senders!r}")
    if senders == "owner" and not getattr(transport_entry(transport), "owner_senders", False):
        raise WeightSyncError(f"weight_sync.senders=owner needs weight_sync.transport=p2p (each engine rank "
                              f"receives its parts point to point), got transport={transport!r}")
    if senders == "owner" and quantized:
        raise WeightSyncError("weight_sync.senders=owner does not send block FP8 yet (the engines' checkpoint has "
                              "a quantization_config): use weight_sync.senders=segment or stage")


class OwnerParts:
    """Which trainer rank sends which part of every engine rank's slices (module docstring).

    Args:
        plan: the whole plan (``senders_per_stage`` 1: copies are split by :func:`assign_senders`).
        placement: the conversion's copy instructions.

    Raises:
        WeightSyncError: a plan with several senders per stage or with block-FP8 wire tensors.
    """

    def __init__(self, plan: WeightSyncPlan, placement: Placement) -> None:
        if plan.senders_per_stage != 1 or plan.quantization is not None:
            raise WeightSyncError("owner senders need a plan with senders_per_stage=1 and no block-FP8 wire "
                                  f"(got senders_per_stage={plan.senders_per_stage}, "
                                  f"quantization={'yes' if plan.quantization is not None else 'no'})")
        self.plan, self.placement = plan, placement
        self.sends: OwnerSends = assign_senders(plan, placement)
        self._parts: dict[tuple[int, int, int], list[Part]] = {}
        self._listings: dict[int, list[list]] = {}
        self._transfers: dict[int, dict] = {}

    def senders(self, pp_rank: int) -> list[int]:
        """Every trainer rank of stage ``pp_rank``: its stage sender first, then ascending."""
        t = self.plan.trainer_layout
        lead = t.sender_rank(pp_rank)
        return [lead] + [r for r in t.stage_ranks(pp_rank) if r != lead]

    def listings(self, bucket: Bucket) -> list[list]:
        """Each engine rank's ``[[name, dtype, shape]]`` of ``bucket`` (its slices, wire order)."""
        if bucket.index not in self._listings:
            out: list[list] = [[] for _ in range(self.plan.engine_layout.tp_size)]
            for spec in bucket.hf_tensors:
                for rank, sl in self.plan.engine_slices_of(spec).items():
                    out[rank].append([spec.name, spec.dtype, list(sl.shape(spec.shape))])
            self._listings[bucket.index] = out
        return self._listings[bucket.index]

    def parts(self, bucket: Bucket, engine: int, rank: int) -> list[Part]:
        """Engine ``engine`` rank ``rank``'s parts of ``bucket`` in arrival order: by sender, then
        by tensor (wire order), then by piece (cached; metadata only)."""
        key = (bucket.index, engine, rank)
        if key not in self._parts:
            pieces: dict[str, list] = {}
            for transfer in bucket.params:
                for piece in self.placement.pieces(transfer):
                    pieces.setdefault(transfer.param.hf[piece.hf_index].name, []).append((transfer, piece))
            out, j = [], 0
            for spec in bucket.hf_tensors:
                sl = self.plan.engine_slices_of(spec).get(rank)
                if sl is None:
                    continue
                for transfer, piece in pieces.get(spec.name, ()):
                    source = transfer.sources[piece.shard]
                    view, axis, offset = owner_part(spec, sl, piece, torch.empty(source.shape, device="meta"))
                    if view is None or view.numel() == 0:
                        continue
                    sender = self.sends.assignment[(transfer.param.name, source.shard_index, engine, rank)]
                    out.append(Part(j, transfer.param.name, source.shard_index, piece, sender, axis, offset,
                                    tuple(view.shape), spec.dtype, sl))
                j += 1
            self._parts[key] = sorted(out, key=lambda p: p.sender)  # stable: tensor then piece order kept
        return self._parts[key]

    def ticket_entry(self, bucket: Bucket, engine: int, rank: int, senders: list[int]) -> dict:
        """Engine ``engine`` rank ``rank``'s entry of ``bucket`` in the stage ticket: its slices
        ``tensors`` ``[[name, dtype, shape]]``, their bytes, and its ``parts`` in arrival order
        ``[[source group rank, tensor index, axis, offset, shape]]`` (``senders``: the group's
        trainer ranks, :meth:`senders`)."""
        listing = self.listings(bucket)[rank]
        nbytes = sum(torch.Size(shape).numel() * torch_dtype(dtype).itemsize for _, dtype, shape in listing)
        return {"bucket": bucket.index, "nbytes": nbytes, "tensors": listing,
                "parts": [[senders.index(p.sender), p.tensor, p.axis, p.offset, list(p.shape)]
                          for p in self.parts(bucket, engine, rank)]}

    def mine(self, bucket: Bucket, engine: int, rank: int, sender: int) -> list[Part]:
        """The parts ``sender`` sends to engine ``engine`` rank ``rank`` of ``bucket``, in order."""
        return [p for p in self.parts(bucket, engine, rank) if p.sender == sender]

    def part_bytes(self, bucket: Bucket, part: Part, local) -> torch.Tensor:
        """``part``'s bytes as its sender sends them: ``[nbytes]`` uint8, contiguous (a view of the
        sender's own shard ``local[part.name]`` where that is contiguous; else a copy).

        Raises:
            WeightSyncError: this rank does not hold the shard, or it has another shape.
        """
        if bucket.index not in self._transfers:
            self._transfers[bucket.index] = {t.param.name: t for t in bucket.params}
        transfer = self._transfers[bucket.index][part.name]
        spec = transfer.param.hf[part.piece.hf_index]
        shard = local.get(part.name)
        source = transfer.sources[part.piece.shard]
        if shard is None or tuple(shard.shape) != tuple(source.shape):
            raise WeightSyncError(f"owner sender: {part.name} shard {part.shard} is "
                                  f"{'missing' if shard is None else tuple(shard.shape)} here, the plan has "
                                  f"{tuple(source.shape)} (assigned to trainer rank {part.sender})")
        view, _, _ = owner_part(spec, part.slice, part.piece, shard.detach())
        view = view.to(torch_dtype(spec.dtype)).contiguous()
        return view.reshape(-1).view(torch.uint8)
