"""Owner senders' assignment: every engine rank's slices leave from trainer ranks that hold them (sent for
real by :mod:`megarl.weight_sync.owners` with ``weight_sync.senders: owner``, BF16 or block FP8).

For each HF tensor of the plan and each engine rank, the placement's pieces (:mod:`copy_instructions`) say
which Megatron shard holds which part of the engine rank's slice. A part is sent by one of the
trainer ranks holding that shard (its *holders*, :func:`holders`): an expert's shard by its EP
owner in one of the expert-data-parallel copies, a TP-split dense shard by the rank of that TP
index in one of the dense copies (CP x DP), a replicated parameter (norms, router, MLA's
``q_a_proj`` / ``kv_a_proj_with_mqa``) by any TP rank of any copy. Nothing is gathered: a trainer
rank sends only bytes it holds, each engine rank receives exactly its own slices (the plan's
``engine_shard_bytes``) once per engine.

Which holder sends a part to which engine (:func:`assign_senders`): parts with the fewest holders
first (an expert with one copy has one), larger first, each to its least-loaded holder so far,
ties to the copy ``engine % copies`` (copies split the engines) and then to the lower rank.
Deterministic: every trainer rank derives the same assignment from metadata.

Block-FP8 engines: a holder quantises its own part (its FP8 bytes and its scale blocks); a 128 x 128
scale block is local when every boundary of the part is a multiple of the block or the tensor's
end (an EP owner's whole expert matrix with ETP 1; a TP slice whose split dimension per shard is a
multiple of 128). :func:`unaligned_parts` lists the pieces that are not: on the shipped FP8
recipes (trainer TP8) MLA's ``q_a_proj`` (1536 rows, 192 per shard) and ``kv_a_proj_with_mqa``
(576, 72 per shard); every other TP-split FP8 dimension is a multiple of 128 (tested). The HF
tensors with such a piece (:func:`receiver_quantized`) are sent unquantised, each part still from
its holder, and every engine rank quantises its assembled slice itself
(:func:`megarl.weight_sync.fp8_wire.quantize_listed`, the same ``quantize_blockwise``; SGLang holds
whole blocks, so the bytes equal the whole tensor's quantised). No trainer collective, at the cost of
the BF16 bytes of those tensors: MLA's two are replicated on every engine rank, +0.92 GB per engine
rank on DeepSeek-V3 (85.14 -> 86.06 GB, 1.01x the bound). (An alternative, not wired: the holders of
a straddled block exchange their parts of its amax, ``quantizer.rows_amax`` / ``quantize_rows``.)
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.engine_slices import PlanError
from megarl.weight_sync.plan import Bucket, ParamTransfer, ShardSource, WeightSyncPlan
from megarl.weight_sync.segments import _overlap_bytes, overlaps


@dataclass
class OwnerSends:
    """The outcome of :func:`assign_senders` (bytes are wire bytes unless said otherwise).

    Attributes:
        sent: ``{trainer rank: bytes}`` each trainer rank sends to all engines together.
        sent_per_stage: ``{pp_rank: {trainer rank: bytes}}``.
        received: ``[engine][engine tp rank]`` bytes each engine rank receives.
        received_per_stage: ``{pp_rank: [engine][engine tp rank]}``.
        shard: ``{trainer rank: bytes}`` of the synced parameters it holds (the trainer's dtype,
            Megatron shard sizes: a replicated parameter counts whole on every holder).
        assignment: ``{(param name, shard index, engine, engine tp rank): trainer rank}``.
        parts: ``{(param name, shard index, engine tp rank): wire bytes}`` of one engine.
    """

    sent: dict[int, int] = field(default_factory=dict)
    sent_per_stage: dict[int, dict[int, int]] = field(default_factory=dict)
    received: list[list[int]] = field(default_factory=list)
    received_per_stage: dict[int, list[list[int]]] = field(default_factory=dict)
    shard: dict[int, int] = field(default_factory=dict)
    assignment: dict[tuple, int] = field(default_factory=dict)
    parts: dict[tuple, int] = field(default_factory=dict)


def holders(plan: WeightSyncPlan, transfer: ParamTransfer, source: ShardSource) -> tuple[int, ...]:
    """Every trainer rank holding ``source`` (a shard of ``transfer``'s parameter), ascending."""
    t, p = plan.trainer_layout, transfer.param
    if p.expert is not None:
        ep_rank, _ = t.expert_location(p.expert, plan.num_experts)
        etps = [source.shard_index] if p.tp_axis is not None and t.etp_size > 1 else range(t.etp_size)
        return tuple(sorted(t.expert_rank(etp_rank=k, ep_rank=ep_rank, edp_rank=d, pp_rank=transfer.pp_rank)
                            for k in etps for d in range(t.expert_data_parallel_size)))
    tps = [source.shard_index] if p.tp_axis is not None and t.tp_size > 1 else range(t.tp_size)
    return tuple(sorted(t.rank(tp_rank=k, cp_rank=c, dp_rank=d, pp_rank=transfer.pp_rank) for k in tps
                        for c in range(t.context_parallel_size) for d in range(t.data_parallel_size)))


def part_region(spec, sl, piece) -> list[tuple[int, int]]:
    """The rows / columns ``[(start, stop)]`` per axis of ``spec`` (an HF tensor) that ``piece``
    fills inside the engine rank's slice ``sl`` (what :func:`owner_part` cuts; empty when they do
    not meet along the piece's axis)."""
    out = [(0, n) for n in spec.shape]
    lo, hi = piece.dst
    if sl.axis == piece.axis:
        met = sl.meet(lo, hi, spec.name)
        lo, hi = met[:2] if met is not None else (lo, lo)
    out[piece.axis] = (lo, hi)
    if sl.axis is not None and sl.axis != piece.axis:
        if len(sl.spans()) > 1:
            raise PlanError(f"{spec.name}: a column piece of a sectioned slice has no one region")
        out[sl.axis] = (sl.start, sl.stop)
    return out


def fp8_part_bytes(region: list[tuple[int, int]], block) -> int:
    """Wire bytes of a block-aligned region of a block-FP8 weight quantised on its own: one byte
    per element plus 4 per scale block (``ceil(extent / block)`` blocks along each axis)."""
    elems = math.prod(b - a for a, b in region)
    blocks = math.prod(-(-(b - a) // k) for (a, b), k in zip(region, block))
    return elems + 4 * blocks


def receiver_quantized(plan: WeightSyncPlan, placement: Placement, bucket) -> frozenset[str]:
    """The block-FP8 HF tensors of ``bucket`` that owner senders send unquantised, for the engine
    rank's receiver to quantise (module docstring): those a Megatron shard fills only in part of a
    scale block (a piece boundary along its axis not a multiple of the block, nor the tensor's end).
    Empty without quantisation."""
    q = plan.quantization
    if q is None:
        return frozenset()
    out = set()
    for transfer in bucket.params:
        for piece in placement.pieces(transfer):
            spec = transfer.param.hf[piece.hf_index]
            if q.is_quantized(spec.name, spec.shape) and any(
                    x % q.block[piece.axis] and x != spec.shape[piece.axis] for x in piece.dst):
                out.add(spec.name)
    return frozenset(out)


def engine_parts(plan: WeightSyncPlan, placement: Placement) -> dict[tuple, int]:
    """``{(param name, shard index, engine tp rank): wire bytes}``: what each Megatron shard gives
    each engine rank of one engine (exact: a block-FP8 part counts its FP8 bytes and scale blocks,
    :func:`fp8_part_bytes`; a receiver-quantised one, :func:`receiver_quantized`, its HF bytes)."""
    parts: dict[tuple, int] = defaultdict(int)
    q = plan.quantization
    for bucket in plan.buckets:
        unquantized = receiver_quantized(plan, placement, bucket)
        by_tensor: dict[str, list] = defaultdict(list)
        for transfer in bucket.params:
            for piece in placement.pieces(transfer):
                by_tensor[transfer.param.hf[piece.hf_index].name].append((transfer, piece))
        for spec in bucket.hf_tensors:
            fp8 = q is not None and spec.name not in unquantized and q.is_quantized(spec.name, spec.shape)
            for rank, sl in plan.engine_slices_of(spec).items():
                for t, p in by_tensor[spec.name]:
                    if not overlaps(sl, p, spec.name):
                        continue
                    n = fp8_part_bytes(part_region(spec, sl, p), q.block) if fp8 and q is not None \
                        else _overlap_bytes(spec, p, sl)
                    if n:
                        parts[(t.param.name, t.sources[p.shard].shard_index, rank)] += n
    return dict(parts)


def assign_senders(plan: WeightSyncPlan, placement: Placement) -> OwnerSends:
    """Which trainer rank sends each part to each engine, and the bytes per link (module docstring).

    Args:
        plan: the whole plan (not a replica's); every engine of ``plan.engine_layout`` is served.
        placement: the conversion's copy instructions.
    """
    t = plan.trainer_layout
    copies = t.replicas_per_stage
    out = OwnerSends(received=[[0] * plan.engine_layout.tp_size for _ in range(plan.engine_layout.num_engines)])
    out.parts = engine_parts(plan, placement)
    transfers = {tr.param.name: tr for b in plan.buckets for tr in b.params}
    cands = {}
    for name, tr in transfers.items():
        for s in tr.sources:
            cands[(name, s.shard_index)] = holders(plan, tr, s)
            for h in cands[(name, s.shard_index)]:
                out.shard[h] = out.shard.get(h, 0) + s.nbytes
    items = sorted(((len(cands[(n, k)]), -b, n, k, r) for (n, k, r), b in out.parts.items() if b))
    load: dict[int, int] = defaultdict(int)
    copy = {h: t.replica_of(h) for hs in set(cands.values()) for h in hs}
    for _, neg, name, k, rank in items:
        group = cands[(name, k)]
        for engine in range(plan.engine_layout.num_engines):
            sender = group[0] if len(group) == 1 else min(
                group, key=lambda h: (load[h], copy[h] != engine % copies, h))
            load[sender] -= neg
            out.assignment[(name, k, engine, rank)] = sender
            out.received[engine][rank] -= neg
            pp_rank = transfers[name].pp_rank
            stage = out.sent_per_stage.setdefault(pp_rank, {})
            stage[sender] = stage.get(sender, 0) - neg
            out.received_per_stage.setdefault(pp_rank, [[0] * len(r) for r in out.received])[engine][rank] -= neg
    out.sent = dict(load)
    return out


def bucket_links(plan: WeightSyncPlan, sends: OwnerSends) -> dict[int, dict[tuple, int]]:
    """``{bucket index: {link: bytes}}``: what each bucket puts on each link with owner senders, a
    link being a trainer rank's outgoing one ``("sent", trainer rank)`` or an engine rank's incoming
    one ``("got", engine, engine tp rank)`` (from ``sends``: :func:`assign_senders` of ``plan``)."""
    position = {tr.param.name: b.index for b in plan.buckets for tr in b.params}
    out: dict[int, dict[tuple, int]] = {b.index: defaultdict(int) for b in plan.buckets}
    for (name, k, engine, rank), sender in sends.assignment.items():
        n = sends.parts.get((name, k, rank), 0)
        if n:
            links = out[position[name]]
            links[("sent", sender)] += n
            links[("got", engine, rank)] += n
    return {b: dict(links) for b, links in out.items()}


ROUND_FILL = 0.8
"""Owner senders' rounds hold about this share of ``weight_sync.bucket_size_mb`` per engine rank
(:func:`plan_rounds`): room for the granularity of a bucket."""


def plan_rounds(plan: WeightSyncPlan, sends: OwnerSends) -> list[tuple[Bucket, ...]]:
    """The rounds owner senders send in (:mod:`megarl.weight_sync.owner_transport`): the buckets
    that travel together and are voted on together, each round's in plan order (stage by stage).

    A round lasts as long as its busiest link (:func:`round_link_bytes`), so every round carries the
    same share of every stage: ``R = ceil(busiest engine rank's bytes / (ROUND_FILL * bucket_size))``
    rounds (an engine rank receives about ``0.8 * weight_sync.bucket_size_mb`` per round, what its
    receive buffers hold: two rounds' worth), and bucket ``j`` of a stage goes to round
    ``floor(c_j * R)``, ``c_j`` the stage's share (by its buckets' busiest engine rank) before the
    bucket's middle. Balanced only with the owner senders' plan (``build_plan(spread_experts=True)``:
    consecutive buckets walk over every EP owner and engine EP rank); with model-order buckets a
    round of consecutive experts lands on one or two engine ranks and owners (and one bucket per
    stage and round, as before, kept them idle between votes: issue 34, paced 4.4-13.9x the bound
    on the GPU recipes). Deterministic (integers and indices): every trainer rank derives the same
    rounds from metadata.

    Args:
        plan: the whole plan (as :func:`assign_senders`); sends: its :func:`assign_senders`.
    """
    links = bucket_links(plan, sends)
    got = {b: max((n for link, n in mine.items() if link[0] == "got"), default=0) for b, mine in links.items()}
    engine_total: dict[tuple, int] = defaultdict(int)
    for mine in links.values():
        for link, n in mine.items():
            if link[0] == "got":
                engine_total[link] += n
    cap = int(plan.bucket_size_bytes * ROUND_FILL)
    num = max(1, min(len(plan.buckets), -(-max(engine_total.values(), default=0) // cap)))
    slots: list[list[Bucket]] = [[] for _ in range(num)]
    for pp_rank in sorted({b.pp_rank for b in plan.buckets}):
        buckets = plan.stage_buckets(pp_rank)
        total, done = sum(got[b.index] for b in buckets) or 1, 0
        for b in buckets:
            slots[min(num - 1, (2 * done + got[b.index]) * num // (2 * total))].append(b)
            done += got[b.index]
    return [tuple(sorted(r, key=lambda b: b.index)) for r in slots if r]


def round_link_bytes(plan: WeightSyncPlan, sends: OwnerSends, rounds: list[tuple] | None = None) -> list[int]:
    """The bytes on the busiest link of each round as owner senders run it (:func:`plan_rounds`):
    a round's buckets are sent at once and voted on together, so it lasts as long as its busiest
    link, a trainer rank's outgoing or an engine rank's incoming bytes of the round; the sync
    takes the sum over rounds.

    Args:
        plan: the whole plan (as :func:`assign_senders`); sends: its :func:`assign_senders`;
        rounds: its :func:`plan_rounds` (None: computed here).
    """
    links = bucket_links(plan, sends)
    out = []
    for r in rounds if rounds is not None else plan_rounds(plan, sends):
        load: dict[tuple, int] = defaultdict(int)
        for bucket in r:
            for link, n in links[bucket.index].items():
                load[link] += n
        out.append(max(load.values(), default=0))
    return out


def unaligned_parts(plan: WeightSyncPlan, placement: Placement) -> list[str]:
    """Block-FP8 HF tensors (``plan.quantization``) a Megatron shard fills only in part of a scale
    block: ``"name rows|cols a:b"`` per piece whose boundary along its axis is not a multiple of the
    block (module docstring). Empty without quantisation."""
    q = plan.quantization
    if q is None:
        return []
    out = []
    for bucket in plan.buckets:
        for transfer in bucket.params:
            pieces = placement.pieces(transfer)
            if len(pieces) < 2:
                continue
            for piece in pieces:
                spec = transfer.param.hf[piece.hf_index]
                if not q.is_quantized(spec.name, spec.shape):
                    continue
                block = q.block[piece.axis]
                end = spec.shape[piece.axis]
                if any(x % block and x != end for x in piece.dst):
                    out.append(f"{spec.name} {('rows', 'cols')[piece.axis]} {piece.dst[0]}:{piece.dst[1]}")
    return out



def owner_part(spec, sl, piece, shard):
    """What a holder sends of one piece of its own shard for one engine rank's slice.

    Args:
        spec: the HF tensor (:class:`~megarl.weight_sync.specs.HFTensorSpec`); sl: the engine
            rank's :class:`~megarl.weight_sync.engine_slices.TensorSlice` of it; piece: a placement
            piece of ``spec`` from this shard; shard: ``[...]`` the holder's own shard (Megatron
            layout, the source's shape).

    Returns:
        ``(view, axis, offset)``: the view of ``shard`` that fills ``piece`` inside ``sl`` (None
        when they do not meet), and where it goes in the engine rank's slice: ``offset`` along
        ``axis`` (the piece's), the whole slice along the other axes.
    """
    lo, hi = piece.dst
    at = lo
    if sl.axis == piece.axis:
        met = sl.meet(lo, hi, spec.name)
        if met is None:
            return None, piece.axis, 0
        lo, hi, at = met
    view = shard.narrow(piece.axis, piece.src[0] + lo - piece.dst[0], hi - lo)
    if sl.axis is not None and sl.axis != piece.axis:
        view = sl.take(view)
    return view, piece.axis, at
