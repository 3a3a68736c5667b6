"""Owner senders, for real: the parts of every engine rank's slices, who sends each, and the bytes.

``weight_sync.senders: owner`` (``p2p``; BF16 or block-FP8 engines). Every trainer rank is a
sender in one group with every engine rank, all stages together (stage by stage, each stage's
sender first, then the other ranks of the stage ascending: :meth:`OwnerParts.group_senders`); the
buckets travel in rounds, packed so that every link carries its share (:meth:`OwnerParts.rounds`). Each engine
rank's slice of an HF tensor is filled by the placement's pieces (:mod:`megarl.weight_sync.copy_instructions`);
the part of a piece inside the slice (:func:`~megarl.weight_sync.senders.owner_part`) leaves the trainer rank that
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

Block-FP8 engines (the served checkpoint has a ``quantization_config``): the engine ranks' listing is
the wire tensors (FP8 weight + ``weight_scale_inv``), and each part of a quantised tensor is two
parts (:attr:`Part.kind` ``fp8`` and ``scale``) its holder quantises from its own shard: the part's
region is whole 128 x 128 blocks (or ends at the tensor's end), so its bytes are those of the whole
tensor quantised (``tests/unit/weight_sync/test_owner_fp8.py``). A tensor a trainer shard fills
off the blocks (MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` at trainer TP8) is listed and sent in
its HF dtype and quantised by the engine rank's receiver (the ticket's ``quantize``;
:func:`megarl.weight_sync.senders.receiver_quantized`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.sync_transports import transport_entry
from megarl.models.fp8_blocks import quantize_blockwise
from megarl.weight_sync.copy_instructions import Piece, Placement
from megarl.weight_sync.engine_slices import TensorSlice
from megarl.weight_sync.fp8_wire import FP8_DTYPE
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket, WeightSyncPlan
from megarl.weight_sync.senders import (
    OwnerSends,
    assign_senders,
    owner_part,
    part_region,
    plan_rounds,
    receiver_quantized,
)
from megarl.weight_sync.specs import torch_dtype

SENDERS = ("owner", "segment", "stage")
"""``weight_sync.senders`` once ``auto`` is resolved (:func:`auto_senders`): ``owner`` (this module),
``segment`` (each engine rank's segment assembled by the trainer rank holding most of it,
:class:`~megarl.weight_sync.segments.SegmentOwners`),
``stage`` (the stage sender gathers and sends everything)."""


def auto_senders(transport: str) -> str:
    """``weight_sync.senders=auto`` by the transport's name: ``owner`` with ``p2p`` and with ``auto``
    (owner senders send through ``p2p``), else ``segment`` (the sender path of the other
    transports). :func:`megarl.weight_sync.synchronizer_build.build_weight_sync` falls back to
    ``segment`` where owner senders cannot run (:func:`~megarl.weight_sync.synchronizer_build.owner_applies`);
    colocated runs ask for ``segment`` (:func:`megarl.weight_sync.choice.run_senders`)."""
    return "owner" if transport in ("p2p", "auto") else "segment"


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
    kind: str = "raw"
    """``raw``: the HF tensor's bytes; ``fp8`` / ``scale``: the block-FP8 weight / its
    ``weight_scale_inv`` blocks of the part, quantised by the sender (``slice`` stays the HF
    tensor's engine slice: the part is cut from it)."""

    @property
    def nbytes(self) -> int:
        """The part's size on the wire (bytes)."""
        return torch.Size(self.shape).numel() * torch_dtype(self.dtype).itemsize


def check_senders(senders: str, *, transport: str, quantized: bool) -> None:
    """``weight_sync.senders`` against the transport and the served checkpoint.

    Raises:
        WeightSyncError: an unknown value; ``owner`` with a transport whose registry entry does not
            declare ``owner_senders`` (``p2p`` does; ``auto`` is refused too).
            (``quantized``: engines serving block FP8; owner senders send it, module docstring.)
    """
    if senders not in SENDERS:
        raise WeightSyncError(f"weight_sync.senders must be one of {' | '.join(SENDERS)}, got {senders!r}")
    if senders == "owner" and not getattr(transport_entry(transport), "owner_senders", False):
        raise WeightSyncError(f"weight_sync.senders=owner needs weight_sync.transport=p2p (each engine rank "
                              f"receives its parts point to point), got transport={transport!r}")


def _check_aligned(spec, region: list[tuple[int, int]], block) -> None:
    """Refuse a block-FP8 part whose scale blocks are not its own (a start off a block boundary, or
    an end neither on one nor the tensor's end): quantising it alone would not give the whole
    tensor's bytes. Pieces off the blocks are receiver-quantised; this catches an engine slice off them.

    Raises:
        WeightSyncError: naming the tensor and the region.
    """
    for axis, ((a, b), k) in enumerate(zip(region, block)):
        if a % k or (b % k and b != spec.shape[axis]):
            raise WeightSyncError(f"owner senders: {spec.name} part {region} is off the {tuple(block)} "
                                  f"FP8 blocks along axis {axis}: its scale blocks are not local")


class OwnerParts:
    """Which trainer rank sends which part of every engine rank's slices (module docstring).

    Args:
        plan: the whole plan (``senders_per_stage`` 1: copies are split by :func:`assign_senders`).
        placement: the conversion's copy instructions.

    Raises:
        WeightSyncError: a plan with several senders per stage.
    """

    def __init__(self, plan: WeightSyncPlan, placement: Placement) -> None:
        if plan.senders_per_stage != 1:
            raise WeightSyncError("owner senders need a plan with senders_per_stage=1 "
                                  f"(got senders_per_stage={plan.senders_per_stage})")
        self.plan, self.placement = plan, placement
        self.sends: OwnerSends = assign_senders(plan, placement)
        self._parts: dict[tuple[int, int, int], list[Part]] = {}
        self._listings: dict[int, list[list]] = {}
        self._transfers: dict[int, dict] = {}
        self._listed: dict[int, list[tuple]] = {}
        self._quantized: tuple[int, dict] = (-1, {})
        self._rounds: list[tuple[Bucket, ...]] | None = None
        self.quantize_s = 0.0
        """Seconds this rank spent quantising its parts (block-FP8 engines)."""

    def senders(self, pp_rank: int) -> list[int]:
        """Every trainer rank of stage ``pp_rank``: its stage sender first, then ascending."""
        t = self.plan.trainer_layout
        lead = t.sender_rank(pp_rank)
        return [lead] + [r for r in t.stage_ranks(pp_rank) if r != lead]

    def group_senders(self) -> list[int]:
        """Every trainer rank of every stage, stage by stage (:meth:`senders`): the ranks ``0 .. n - 1``
        of the one group all stages deliver through (the stage 0 sender, the coordinator, first)."""
        return [r for pp in sorted({b.pp_rank for b in self.plan.buckets}) for r in self.senders(pp)]

    def rounds(self) -> list[tuple[Bucket, ...]]:
        """The buckets that travel together (plan order within a round); the engines receive a
        round's buckets at once and vote on it once (:func:`~megarl.weight_sync.senders.plan_rounds`:
        packed so that every link carries its share; cached)."""
        if self._rounds is None:
            self._rounds = plan_rounds(self.plan, self.sends)
        return self._rounds

    def stage_order(self, pp_rank: int) -> list[Bucket]:
        """The buckets of stage ``pp_rank`` in the order its ranks send them: round by round."""
        return [b for r in self.rounds() for b in r if b.pp_rank == pp_rank]

    def listed(self, bucket: Bucket) -> list[tuple]:
        """What the engine ranks receive of ``bucket``, wire order: ``[(listed spec, HF spec, kind)]``
        (kind as :attr:`Part.kind`). Without quantisation the HF tensors; with it the wire tensors
        (FP8 weight + scale), except a receiver-quantised tensor (:func:`receiver_quantized`),
        listed in its HF dtype; decreasing element size, so every view of the buffer is aligned."""
        if bucket.index not in self._listed:
            if self.plan.quantization is None:
                out = [(spec, spec, "raw") for spec in bucket.hf_tensors]
            else:
                unquantized = receiver_quantized(self.plan, self.placement, bucket)
                hf = {spec.name: spec for spec in bucket.hf_tensors}
                out = []
                for w in bucket.wire:
                    base = hf[w.scale_of.name if w.scale_of is not None else w.name]
                    if base.name in unquantized:
                        if w.scale_of is None:
                            out.append((base, base, "raw"))
                    else:
                        kind = "scale" if w.scale_of is not None else "fp8" if w.dtype == FP8_DTYPE else "raw"
                        out.append((w, base, kind))
                out.sort(key=lambda x: -x[0].itemsize)
            self._listed[bucket.index] = out
        return self._listed[bucket.index]

    def listings(self, bucket: Bucket) -> list[list]:
        """Each engine rank's ``[[name, dtype, shape]]`` of ``bucket`` (its slices, wire order)."""
        if bucket.index not in self._listings:
            out: list[list] = [[] for _ in range(self.plan.engine_layout.tp_size)]
            for spec, _, _ in self.listed(bucket):
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
            for listed, spec, kind in self.listed(bucket):
                sl = self.plan.engine_slices_of(spec).get(rank)
                if sl is None:
                    continue
                for transfer, piece in pieces.get(spec.name, ()):
                    source = transfer.sources[piece.shard]
                    view, axis, offset = owner_part(spec, sl, piece, torch.empty(source.shape, device="meta"))
                    if view is None or view.numel() == 0:
                        continue
                    shape = tuple(view.shape)
                    if kind != "raw":
                        _check_aligned(spec, part_region(spec, sl, piece), self.plan.quantization.block)  # type: ignore[union-attr]
                    if kind == "scale":  # the part's scale blocks, at its first block in the rank's scale slice
                        region, block = part_region(spec, sl, piece), listed.block
                        shape = tuple(-(-(b - a) // k) for (a, b), k in zip(region, block))
                        scale_sl = self.plan.engine_slices_of(listed)[rank]
                        offset = region[axis][0] // block[axis] - (scale_sl.start if scale_sl.axis == axis else 0)
                    sender = self.sends.assignment[(transfer.param.name, source.shard_index, engine, rank)]
                    out.append(Part(j, transfer.param.name, source.shard_index, piece, sender, axis, offset,
                                    shape, listed.dtype, sl, kind))
                j += 1
            self._parts[key] = sorted(out, key=lambda p: p.sender)  # stable: tensor then piece order kept
        return self._parts[key]

    def ticket_entry(self, bucket: Bucket, engine: int, rank: int, senders: list[int]) -> dict:
        """Engine ``engine`` rank ``rank``'s entry of ``bucket`` in the stage ticket: its slices
        ``tensors`` ``[[name, dtype, shape]]``, their bytes, its ``parts`` in arrival order
        ``[[source group rank, tensor index, axis, offset, shape]]`` (``senders``: the group's
        trainer ranks, :meth:`senders`) and, where the engines serve block FP8, ``quantize``
        ``[[tensor index, block rows, block cols]]``: the tensors it receives in their HF dtype and
        quantises itself (:func:`~megarl.weight_sync.senders.receiver_quantized`; absent if none)."""
        listing = self.listings(bucket)[rank]
        nbytes = sum(torch.Size(shape).numel() * torch_dtype(dtype).itemsize for _, dtype, shape in listing)
        entry = {"bucket": bucket.index, "nbytes": nbytes, "tensors": listing,
                 "parts": [[senders.index(p.sender), p.tensor, p.axis, p.offset, list(p.shape)]
                           for p in self.parts(bucket, engine, rank)]}
        q = self.plan.quantization
        if q is not None:  # receiver-quantised tensors: [[tensor index, block rows, block cols]]
            mine = [(listed, kind) for listed, _, kind in self.listed(bucket)
                    if rank in self.plan.engine_slices_of(listed)]
            quantize = [[j, *q.block] for j, (listed, kind) in enumerate(mine)
                        if kind == "raw" and q.is_quantized(listed.name, listed.shape)]
            if quantize:
                entry["quantize"] = quantize
        return entry

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
        view = view.to(torch_dtype(spec.dtype))
        if part.kind != "raw":
            view = self._quantize(bucket, part, view)
        return view.contiguous().reshape(-1).view(torch.uint8)

    def _quantize(self, bucket: Bucket, part: Part, view: torch.Tensor) -> torch.Tensor:
        """``part``'s FP8 bytes or scale blocks: its block-aligned view quantised on its own (the
        same bytes as those blocks of the whole tensor quantised, as every 128 x 128 block lies
        inside it). The FP8 weight and its scale of one part are quantised once (per bucket)."""
        import time

        if self._quantized[0] != bucket.index:
            self._quantized = (bucket.index, {})
        cache = self._quantized[1]
        key = (part.name, part.shard, part.piece, part.slice)
        if key not in cache:
            started = time.perf_counter()
            block = self.plan.quantization.block  # type: ignore[union-attr]  # kind != raw: quantised
            cache[key] = quantize_blockwise(view, block)
            self.quantize_s += time.perf_counter() - started
        q, scale = cache[key]
        return scale if part.kind == "scale" else q
