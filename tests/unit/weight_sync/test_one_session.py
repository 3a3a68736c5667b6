"""Owner senders deliver every pipeline stage at once (issue 34 part 1's last item) and are the default
where they apply (``weight_sync.senders: auto``), on paper and by the rules, no processes.

References: ``megarl plan-sync``'s owner prediction against the bytes the owner transport really puts
on each link per round, counted here from :class:`~megarl.weight_sync.owners.OwnerParts` (the parts
each trainer rank sends each engine rank, what the tickets list) and its rounds; the resolution rule
against the cases the config reference names. The transport itself, PP2 into a real SGLang engine:
``tests/integration/weight_sync/test_owner_sync.py``."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_owner_senders import MOE, _moe_plan

from megarl.weight_sync.layout import EngineLayout, TrainerLayout

GB = 1e9
PP2 = TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                    expert_tensor_parallel_size=1, data_parallel_size=2)


def _busiest(parts, buckets) -> int:
    """The most bytes one link carries while ``buckets`` travel together, from the parts the
    transport sends (each trainer rank's outgoing, each engine rank's incoming)."""
    plan = parts.plan
    sent: dict = {}
    got: dict = {}
    for bucket in buckets:
        for engine in range(plan.engine_layout.num_engines):
            for rank in range(plan.engine_layout.tp_size):
                for p in parts.parts(bucket, engine, rank):
                    sent[p.sender] = sent.get(p.sender, 0) + p.nbytes
                    got[(engine, rank)] = got.get((engine, rank), 0) + p.nbytes
    return max([*sent.values(), *got.values()])


@pytest.mark.parametrize("engines", [EngineLayout(tensor_parallel_size=2, num_engines=2),
                                     EngineLayout(tensor_parallel_size=4, num_engines=1)])
def test_plan_sync_predicts_the_rounds_the_owner_transport_sends(engines):
    """The prediction is the sum over rounds of each round's busiest link, counted from the parts
    the transport sends; every bucket travels once, each stage's round by round; rounds carry both
    stages' buckets; all stages at once is never slower than bucket after bucket, stage after stage
    (a session per stage). How the rounds are packed: ``test_owner_rounds.py``."""
    from megarl.weight_sync.owner_predict import format_owner_prediction, predict_owner_senders
    from megarl.weight_sync.owners import OwnerParts

    plan, placement = _moe_plan(PP2, engines, MOE)
    plan = replace(plan, senders_per_stage=1)  # owner senders' plan (the copies split the engines themselves)
    parts = OwnerParts(plan, placement)
    pred = predict_owner_senders(plan, placement, inter_gbps=50.0)
    rounds = parts.rounds()
    stages = [plan.stage_buckets(pp) for pp in (0, 1)]
    # every bucket once; each stage sends round by round (plan order inside a round); both stages
    # travel together
    assert sorted(b.index for r in rounds for b in r) == [b.index for b in plan.buckets]
    for pp in (0, 1):
        assert parts.stage_order(pp) == [b for r in rounds for b in r if b.pp_rank == pp]
        assert sorted(b.index for b in parts.stage_order(pp)) == [b.index for b in stages[pp]]
    assert len(rounds) > 1 and any(len({b.pp_rank for b in r}) == 2 for r in rounds)
    assert pred.rounds == len(rounds)
    assert pred.seconds * 50.0 * GB == pytest.approx(sum(_busiest(parts, r) for r in rounds), rel=1e-12)
    # bucket after bucket, stage after stage (one session per stage): never faster
    one_by_one = sum(_busiest(parts, [b]) for b in plan.buckets)
    assert pred.unpaced_s <= pred.seconds <= one_by_one / (50.0 * GB)
    assert parts.group_senders() == [*parts.senders(0), *parts.senders(1)]  # one group, stage 0's sender first
    line = format_owner_prediction(plan, pred, inter_gbps=50.0, senders="owner")[1]
    assert f"what runs (weight_sync.senders=owner), all stages at once in {len(rounds)} rounds] predicted " \
           f"{pred.seconds:.2f} s" in line, line
    other = format_owner_prediction(plan, pred, inter_gbps=50.0, senders="segment")[1]
    assert "not selected (weight_sync.senders=segment" in other


def _cfg(senders="auto", transport="auto", placement="disaggregated", device="cuda"):
    return SimpleNamespace(weight_sync=SimpleNamespace(senders=senders, transport=transport, senders_per_stage=None),
                           cluster=SimpleNamespace(placement=placement, device=device))


def test_senders_auto_is_the_default_and_resolves_to_owner_where_it_applies():
    """``auto``: ``owner`` for disaggregated ``p2p`` / ``auto`` runs (NCCL or gloo); ``segment`` for
    colocated runs, other transports; explicit values kept; plan built with one sender per stage
    for owner."""
    from megarl.config.schema import WeightSyncConfig
    from megarl.weight_sync.choice import run_senders, senders_on_paper
    from megarl.weight_sync.owners import auto_senders
    from megarl.weight_sync.synchronizer_build import senders_per_stage

    assert WeightSyncConfig().senders == "auto" and WeightSyncConfig().transport == "auto"
    assert [auto_senders(t) for t in ("p2p", "auto", "distributed", "shard", "tensor", "disk")] == \
           ["owner", "owner", "segment", "segment", "segment", "segment"]
    assert senders_on_paper(_cfg()) == "owner"  # disaggregated, NCCL
    assert senders_on_paper(_cfg(device="cpu")) == "owner"  # disaggregated, gloo
    assert senders_on_paper(_cfg(transport="p2p")) == "owner"
    assert senders_on_paper(_cfg(transport="distributed")) == "segment"
    assert run_senders(_cfg(placement="colocated", device="cpu")) == "segment"
    assert senders_on_paper(_cfg(placement="colocated")) == "segment"  # and tensor on CUDA
    assert run_senders(_cfg()) == "auto"  # resolved by build_weight_sync with the plan and the engines
    for explicit in ("owner", "segment", "stage"):
        assert run_senders(_cfg(senders=explicit, placement="colocated")) == explicit
    ws = SimpleNamespace(senders="auto", transport="auto", senders_per_stage=3)
    assert senders_per_stage(ws) == 1 and senders_per_stage(ws, "segment") == 3
    assert senders_per_stage(SimpleNamespace(senders="auto", transport="distributed", senders_per_stage=3)) == 3


def test_owner_applies_only_where_the_engines_load_every_tensor_pre_sharded():
    """The fallback to ``segment``: an engine layout SGLang cannot load pre-sharded (2 kv heads over
    TP3) is refused before any engine is asked; with ``transport: p2p`` the engines are not asked."""
    from megarl.weight_sync.synchronizer_build import owner_applies

    plan, _ = _moe_plan(PP2, EngineLayout(tensor_parallel_size=2), MOE)
    assert owner_applies(plan, "p2p", [])
    odd, _ = _moe_plan(PP2, EngineLayout(tensor_parallel_size=3), MOE)
    assert not owner_applies(odd, "auto", ["http://127.0.0.1:9"])  # unreachable: never asked


def test_megarl_validate_takes_senders_auto_and_names_the_field_where_owner_cannot_work():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from config_issues import validate_issues

    assert "weight_sync.senders" not in validate_issues([])  # the default, auto
    assert "weight_sync.senders" not in validate_issues(["weight_sync.senders=auto", "weight_sync.transport=disk"])
    issues = validate_issues(["weight_sync.senders=owner", "weight_sync.transport=distributed"])
    assert "needs weight_sync.transport=p2p" in issues["weight_sync.senders"], issues
