"""Owner senders on paper (``megarl plan-sync``'s owner block, ``megarl plan``'s p2p seconds where owner
senders run): the sync as it runs, round by round, against the physical bound.

Every trainer rank sends the parts it holds (:mod:`megarl.weight_sync.senders`), all stages at once
through one update request per engine (:mod:`megarl.weight_sync.owner_transport`), each over its own
link, and each engine rank receives its own slices over its own. The plan is the owner senders' own
(``build_plan(..., spread_experts=True)``, :func:`megarl.weight_sync.predict.plan_from_config`
with ``senders="owner"``): each layer's experts spread over the buckets, the buckets packed into
rounds that load every link alike (:func:`~megarl.weight_sync.senders.plan_rounds`). Not modelled,
as in :mod:`megarl.weight_sync.predict`: per-round latency (tickets are per sync; one vote per
round), the engines' load time, conversion copies, contention with training traffic.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.weight_sync.plan import WeightSyncPlan
from megarl.weight_sync.senders import OwnerSends, assign_senders, plan_rounds, round_link_bytes, unaligned_parts

GB = 1e9


@dataclass
class OwnerPrediction:
    """``p2p`` with owner senders (:mod:`megarl.weight_sync.senders`), against the physical bound.

    Every trainer rank sends the parts it holds, all stages at once through one update request per
    engine (:mod:`megarl.weight_sync.owner_transport`), each over its own link, and each engine rank
    receives its own slices over its own; the buckets travel in rounds packed so that every link
    carries its share (:func:`~megarl.weight_sync.senders.plan_rounds`), each voted on together:
    ``seconds = sum over rounds of the round's busiest link / inter_gbps``
    (:func:`~megarl.weight_sync.senders.round_link_bytes`: what runs). ``unpaced_s``: the busiest
    link over the whole sync (``max(busiest trainer link, busiest engine link) / inter_gbps``), what
    no pacing between rounds would give. ``bound_bytes``: what the busiest engine rank must receive
    (its slices, once: ``plan.engine_shard_bytes``), ``bound_s`` that over its link.
    """

    sends: OwnerSends
    seconds: float
    unpaced_s: float
    rounds: int
    """Rounds of the sync (:func:`~megarl.weight_sync.senders.plan_rounds`)."""
    bound_bytes: int
    bound_s: float
    unaligned: list[str]
    """Block-FP8 pieces off block boundaries (``senders.unaligned_parts``)."""


def physical_bound(plan: WeightSyncPlan, inter_gbps: float) -> tuple[int, float]:
    """``(bytes, seconds)``: the bytes the busiest engine rank must receive (its own slices of every
    served tensor, once) and the time that takes over its own link at ``inter_gbps`` GB/s."""
    nbytes = max(plan.engine_shard_bytes())
    return nbytes, nbytes / (inter_gbps * GB)


def predict_owner_senders(plan: WeightSyncPlan, placement, *, inter_gbps: float) -> OwnerPrediction:
    """The sync with owner senders on paper (:class:`OwnerPrediction`).

    Raises:
        ValueError: a non-positive ``inter_gbps``.
    """
    if inter_gbps <= 0:
        raise ValueError("inter_gbps must be > 0 GB/s")
    sends = assign_senders(plan, placement)
    busiest = max(max(sends.sent.values(), default=0), max(max(r) for r in sends.received))
    rounds = round_link_bytes(plan, sends, plan_rounds(plan, sends))
    nbytes, bound_s = physical_bound(plan, inter_gbps)
    return OwnerPrediction(sends, sum(rounds) / (inter_gbps * GB), busiest / (inter_gbps * GB), len(rounds),
                           nbytes, bound_s, unaligned_parts(plan, placement))


def format_owner_prediction(plan: WeightSyncPlan, p: OwnerPrediction, *, inter_gbps: float,
                            senders: str = "owner") -> list[str]:
    """The owner-sender block of ``megarl plan-sync``: the bound, the prediction, every trainer rank's
    outgoing bytes (GB, 1e9) and its ratio to its own shard times the engines. ``senders``: the
    run's ``weight_sync.senders`` resolved (``auto``:
    :func:`~megarl.weight_sync.choice.senders_on_paper`); with ``owner``
    the line says it is the path that runs, else that the ``[p2p]`` block below is."""
    engines = plan.engine_layout.num_engines
    ratio = max((p.sends.sent.get(h, 0) / (n * engines) for h, n in p.sends.shard.items() if n), default=0.0)
    head = ("what runs (weight_sync.senders=owner)" if senders == "owner" else
            f"not selected (weight_sync.senders={senders}; the running p2p sends as the [p2p] block below)")
    lines = [f"physical bound: the busiest engine rank receives {p.bound_bytes / GB:.2f} GB over its own "
             f"{inter_gbps:g} GB/s link: {p.bound_s:.2f} s",
             f"[p2p, owner senders: {head}, all stages at once in {p.rounds} rounds] predicted {p.seconds:.2f} s = "
             f"{p.seconds / p.bound_s:.2f} x the bound (unpaced: {p.unpaced_s:.2f} s)"
             + ("; the [p2p] block below is segment senders, for comparison" if senders == "owner" else "")
             + f"; trainer rank sent max {max(p.sends.sent.values()) / GB:.2f} GB, max sent / (own shard x "
             f"{engines} engines) {ratio:.2f}"]
    if p.unaligned:
        lines.append(f"  {len(p.unaligned)} block-FP8 pieces off 128-row blocks (e.g. {p.unaligned[0]}): their "
                     f"tensors go in BF16 and each engine rank quantises its slice (senders.receiver_quantized; "
                     f"counted above)")
    ranks = sorted(p.sends.shard)
    cells = [f"{r}: {p.sends.sent.get(r, 0) / GB:.2f}" for r in ranks]
    lines.append("  outgoing GB per trainer rank:")
    lines.extend("    " + "  ".join(cells[i:i + 8]) for i in range(0, len(cells), 8))
    return lines
