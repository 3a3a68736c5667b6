"""Owner senders' buckets and rounds load every link alike (issue 34 part 1: the paced prediction
within 1.25x the physical bound), on paper, no processes.

References: the bytes each link carries per round counted here from
:class:`~megarl.weight_sync.owners.OwnerParts` (the parts the owner transport sends and the tickets
list), not from :func:`~megarl.weight_sync.senders.bucket_links`; the bound is each engine rank's
own slices (``plan.engine_shard_bytes``); the experts' owners and engine EP ranks are recounted from
the contiguous blocks both sides hold. The layout is DeepSeek-V3's recipe in small: one
expert-data-parallel copy (EP = world), 64 experts over 8 trainer ranks, two engines of TP4 x EP4,
buckets of a few experts. Model order, one bucket per round (before): 6.8x the bound.
"""
from __future__ import annotations

import pytest
from test_load_groups import _members
from test_owner_senders import MLA, MOE, _moe_plan

from megarl.weight_sync.layout import EngineLayout, TrainerLayout, spread_expert_order
from megarl.weight_sync.senders import ROUND_FILL

DEEPSEEK_SHAPE = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=8,
                               expert_tensor_parallel_size=1, data_parallel_size=4)
PP2 = TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=8,
                    expert_tensor_parallel_size=1, data_parallel_size=4)
ENGINES = EngineLayout(tensor_parallel_size=4, expert_parallel_size=4, num_engines=2)
MANY_EXPERTS = dict(MOE, num_experts=64, num_hidden_layers=4, moe_intermediate_size=64)


def _round_links(parts, buckets) -> dict:
    """``{link: bytes}`` while ``buckets`` travel together: each trainer rank's outgoing
    ``("sent", rank)`` and each engine rank's incoming ``("got", engine, rank)``, from the parts."""
    plan, out = parts.plan, {}
    for bucket in buckets:
        for engine in range(plan.engine_layout.num_engines):
            for rank in range(plan.engine_layout.tp_size):
                for p in parts.parts(bucket, engine, rank):
                    for link in (("sent", p.sender), ("got", engine, rank)):
                        out[link] = out.get(link, 0) + p.nbytes
    return out


def _owner_plan(trainer, spread: bool, bucket_mb: float = 0.1):
    """``(plan, placement, OwnerParts)`` of ``MANY_EXPERTS`` at ``trainer`` -> ``ENGINES`` (one sender
    per stage, as owner senders' plans; ``spread``: ``build_plan``'s ``spread_experts``)."""
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.owners import OwnerParts
    from megarl.weight_sync.plan import build_plan

    _, placement = _moe_plan(trainer, ENGINES, MANY_EXPERTS)  # the family's copy instructions
    specs = param_specs_from_hf_config(MANY_EXPERTS, tensor_model_parallel_size=trainer.tp_size, dtype="bfloat16")
    plan = build_plan(trainer, ENGINES, specs, bucket_size_mb=bucket_mb, spread_experts=spread, senders_per_stage=1)
    return plan, placement, OwnerParts(plan, placement)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainer", [DEEPSEEK_SHAPE, PP2], ids=["pp1", "pp2"])
def test_rounds_carry_every_link_its_share_and_the_prediction_is_within_the_bound(trainer):
    """Every bucket travels once; each stage sends round by round; an engine rank receives at most a
    bucket size per round on average, give or take a bucket per stage (its receive buffers); the prediction is the sum
    over rounds of the busiest link counted from the parts, and within 1.25x the bound, where the
    model-order buckets, one per stage and round, the rounds as they were, take over 3x."""
    from megarl.weight_sync.owner_predict import predict_owner_senders

    plan, placement, parts = _owner_plan(trainer, spread=True)
    rounds = parts.rounds()
    assert sorted(b.index for r in rounds for b in r) == [b.index for b in plan.buckets]
    for pp in range(trainer.pp_size):
        assert parts.stage_order(pp) == [b for r in rounds for b in r if b.pp_rank == pp]
    assert all(list(r) == sorted(r, key=lambda b: b.index) for r in rounds)
    loads = [_round_links(parts, r) for r in rounds]
    got = [max(n for link, n in load.items() if link[0] == "got") for load in loads]
    bucket_got = max(max(n for link, n in _round_links(parts, [b]).items() if link[0] == "got") for b in plan.buckets)
    assert sum(got) / len(got) <= plan.bucket_size_bytes  # about ROUND_FILL bucket sizes per round
    assert max(got) <= ROUND_FILL * plan.bucket_size_bytes + trainer.pp_size * bucket_got  # a bucket per stage
    if trainer.pp_size > 1:  # the stages travel together
        assert sum(len({b.pp_rank for b in r}) > 1 for r in rounds) >= len(rounds) // 2
    pred = predict_owner_senders(plan, placement, inter_gbps=50.0)
    assert pred.rounds == len(rounds)
    assert pred.seconds * 50e9 == pytest.approx(sum(max(load.values()) for load in loads), rel=1e-12)
    bound = max(plan.engine_shard_bytes())
    assert pred.bound_bytes == bound
    assert pred.unpaced_s <= pred.seconds <= 1.25 * pred.bound_s, (pred.seconds / pred.bound_s)
    before, _, old = _owner_plan(trainer, spread=False)
    by_stage = [before.stage_buckets(pp) for pp in range(trainer.pp_size)]
    one_per_stage = [[s[k] for s in by_stage if k < len(s)] for k in range(max(map(len, by_stage)))]
    paced_before = sum(max(_round_links(old, r).values()) for r in one_per_stage)
    assert paced_before > 3 * max(before.engine_shard_bytes())


def test_spread_order_walks_over_every_owner_and_engine_rank():
    """DeepSeek-V3's recipe (256 experts, trainer EP128, engine EP8), Kimi-K2's (384, EP192, EP16),
    GLM-4.5's (160, EP16, EP8), Qwen3-30B-A3B's (128, EP8, engine EP1), and sizes that do not nest:
    a permutation; every window of ``E / max(block)`` consecutive experts lies in as many different
    owners and engine EP ranks (counted from the contiguous blocks), every window of ``E / min(block)``
    in every block of the finer side once."""
    for experts, trainer_ep, engine_ep in ((256, 128, 8), (384, 192, 16), (160, 16, 8), (128, 8, 1), (12, 3, 2)):
        order = spread_expert_order(experts, trainer_ep, engine_ep)
        assert sorted(order) == list(range(experts))
        owner, engine = experts // trainer_ep, experts // engine_ep
        if max(owner, engine) % min(owner, engine):  # not nested: owner after owner
            assert [e // owner for e in order[:trainer_ep]] == list(range(trainer_ep))
            continue
        wide, fine = experts // max(owner, engine), experts // min(owner, engine)
        for at in range(0, experts, wide):
            window = order[at:at + wide]
            assert len({e // owner for e in window}) == len({e // engine for e in window}) == wide == len(window)
        for at in range(0, experts, fine):
            assert len({e // min(owner, engine) for e in order[at:at + fine]}) == fine


@pytest.mark.timeout(120)
def test_spread_buckets_hold_the_same_tensors_and_keep_load_groups_whole():
    """The owner senders' plan: the same HF tensors once each, DeepSeek-V3's ``q_a_proj`` +
    ``kv_a_proj_with_mqa`` in one bucket (at every bucket size here), and each layer's experts
    spread: a bucket holds as many owners (recounted from the EP blocks) as experts of a layer, up
    to EP (model order: one or two)."""
    from collections import Counter

    from megarl.models.families import get_family
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    for config, family in ((MLA, "deepseek_v3"), (MANY_EXPERTS, None)):
        specs = param_specs_from_hf_config(config, tensor_model_parallel_size=2, dtype="bfloat16")
        for mb in (0.001, 0.01, 0.05):
            spread = build_plan(DEEPSEEK_SHAPE if config is MANY_EXPERTS else TrainerLayout(
                tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                data_parallel_size=2), ENGINES if config is MANY_EXPERTS else EngineLayout(tensor_parallel_size=2),
                specs, bucket_size_mb=mb, spread_experts=True)
            assert Counter(t.name for t in spread.hf_tensors()) == Counter(h.name for p in specs for h in p.hf)
            layout = spread.trainer_layout
            for b in spread.buckets:  # consecutive experts of a layer: as many owners as experts (up to EP)
                for layer in {t.param.layer for t in b.params if t.param.expert is not None}:
                    experts = {t.param.expert for t in b.params if t.param.layer == layer and t.param.expert is not None}
                    owners = {layout.expert_location(e, spread.num_experts)[0] for e in experts}
                    assert len(owners) == min(len(experts), layout.ep_size), (b.index, sorted(experts))
            if family is not None:
                for key, buckets in _members(spread, get_family(family)).items():
                    assert len(set(buckets)) == 1, (key, buckets)
