"""Owner senders' parts on real tensors, no processes: every trainer rank cuts its assigned parts from
its own shard (``OwnerParts.part_bytes``), the receiver's placement (``receiver.part_targets`` +
``place_parts``, as inside the engine) rebuilds each engine rank's slices from the ticket alone, and
they equal the family's ``to_hf`` of the gathered parameter sliced as SGLang holds it; a flipped
byte names its tensor, a missing part is refused."""
import pytest
import torch
from test_owner_senders import MLA, MOE, _moe_plan

from megarl.weight_sync.layout import EngineLayout, TrainerLayout

MINIMAX = {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 256,
           "rotary_dim": 8, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
           "use_routing_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _shards(plan, placement):
    """``(references, local)``: per HF tensor the whole converted tensor (from the gathered
    parameter), and per trainer rank ``{name: its shard}`` for every shard it holds."""
    from megarl.models.mapping import lookup, split_tp, to_hf
    from megarl.weight_sync.senders import holders
    from megarl.weight_sync.specs import torch_dtype

    torch.manual_seed(0)
    references, local = {}, {r: {} for r in range(plan.trainer_layout.world_size)}
    for bucket in plan.buckets:
        for transfer in bucket.params:
            entry, _ = lookup(placement.table, transfer.param.name)
            full = torch.randn(transfer.param.shape).to(torch_dtype(transfer.param.dtype))
            for spec, tensor in zip(transfer.param.hf, to_hf(entry, full, placement.layout)):
                references[spec.name] = tensor
            n = len(transfer.sources)
            for source in transfer.sources:
                shard = split_tp(full, entry.tp_split, source.shard_index, n).contiguous()
                for rank in holders(plan, transfer, source):
                    local[rank][transfer.param.name] = shard
    return references, local


def _deliver(parts, bucket, engine, rank, local, corrupt=None):
    """One engine rank's bucket as the receiver assembles it: ``(status, at, slices, entry)``."""
    from megarl.weight_sync.receiver import part_targets, place_parts
    from megarl.weight_sync.wire import checksum

    senders = parts.senders(bucket.pp_rank)
    entry = parts.ticket_entry(bucket, engine, rank, senders)
    if corrupt == "drop":
        entry = dict(entry, parts=entry["parts"][:-1])
    slices, placed = part_targets(torch.zeros(entry["nbytes"], dtype=torch.uint8), entry)
    sums: dict = {}
    for (source, j, _target, into, k), part in zip(placed, parts.parts(bucket, engine, rank)):
        assert senders[source] == part.sender and j == part.tensor
        data = parts.part_bytes(bucket, part, local[part.sender])
        sums.setdefault(source, []).append(checksum(data, "xxh3"))
        into.reshape(-1).view(torch.uint8).copy_(data)
        if corrupt == "flip" and k == 0:
            into.reshape(-1).view(torch.uint8)[1] ^= 0xFF
    status, at = place_parts(placed, sums, slices, "xxh3")
    return status, at, slices, entry


@pytest.mark.parametrize("trainer, engines, config", [
    # DeepSeek-V3's shape: one expert copy over every rank, two dense copies; engine TP4 wider than
    # the trainer's TP2 (column parts of o_proj / down_proj land strided)
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=4, num_engines=2), MOE),
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=2, expert_parallel_size=2, num_engines=2),
     MLA),
    # PP2 x ETP2: stages, expert tensor shards
    (TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                   expert_tensor_parallel_size=2, data_parallel_size=2), EngineLayout(tensor_parallel_size=2), MOE),
    # engine TP1 from trainer TP2: a whole o_proj / down_proj slice of two column parts (strided)
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
     EngineLayout(tensor_parallel_size=1), MOE),
    # MiniMax-M2: block_sparse_moe experts by id; q/k norms replicated on the trainer, split by heads on the
    # engine (engine TP4 over 2 kv heads: each k_norm head on two ranks)
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=4, expert_parallel_size=2, num_engines=2),
     MINIMAX),
], ids=["qwen3_moe-ep4-engine_tp4x2", "mla-ep4-engine_tp2ep2x2", "qwen3_moe-pp2-etp2", "qwen3_moe-engine_tp1",
        "minimax_m2-ep4-engine_tp4ep2x2"])
def test_parts_rebuild_every_engine_rank_slice_from_the_ticket(trainer, engines, config):
    from megarl.weight_sync.owners import OwnerParts

    plan, placement = _moe_plan(trainer, engines, config)
    parts = OwnerParts(plan, placement)
    references, local = _shards(plan, placement)
    cut: dict[int, int] = {}
    for bucket in plan.buckets:
        for engine in range(engines.num_engines):
            for rank in range(engines.tp_size):
                status, at, slices, entry = _deliver(parts, bucket, engine, rank, local)
                assert (status, at) == (0, 0), (bucket.index, engine, rank)
                for (name, _, _), got in zip(entry["tensors"], slices):
                    spec = next(t for t in bucket.hf_tensors if t.name == name)
                    sl = plan.engine_slices_of(spec)[rank]
                    ref = references[name] if sl.axis is None else references[name].narrow(
                        sl.axis, sl.start, sl.stop - sl.start)
                    assert torch.equal(got, ref), (name, engine, rank)
                for part in parts.parts(bucket, engine, rank):
                    cut[part.sender] = cut.get(part.sender, 0) + part.nbytes
    assert cut == parts.sends.sent  # no rank sends more (or less) than the plan's own parts
    assert set(cut) == set(range(trainer.world_size))  # every trainer rank sends


def test_a_flipped_part_names_its_tensor_and_a_missing_part_is_refused():
    from megarl.weight_sync.owners import OwnerParts

    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                            expert_tensor_parallel_size=1, data_parallel_size=2)
    plan, placement = _moe_plan(trainer, EngineLayout(tensor_parallel_size=4, num_engines=2), MOE)
    parts = OwnerParts(plan, placement)
    _, local = _shards(plan, placement)
    bucket = plan.buckets[0]
    first = parts.parts(bucket, 1, 2)[0]
    status, at, _, _ = _deliver(parts, bucket, 1, 2, local, corrupt="flip")
    assert (status, at) == (1, first.tensor)
    status, at, _, _ = _deliver(parts, bucket, 1, 2, local, corrupt="drop")
    assert status == 5 and at == parts.parts(bucket, 1, 2)[-1].tensor


def test_owner_senders_refuse_other_transports_by_name():
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.owners import check_senders

    check_senders("owner", transport="p2p", quantized=False)
    with pytest.raises(WeightSyncError, match="weight_sync.senders must be one of owner | segment | stage"):
        check_senders("owners", transport="p2p", quantized=False)
    with pytest.raises(WeightSyncError, match="needs weight_sync.transport=p2p"):
        check_senders("owner", transport="distributed", quantized=False)
    check_senders("owner", transport="p2p", quantized=True)  # block FP8: test_owner_fp8.py


def test_plan_sync_names_the_sender_path_that_runs():
    """``megarl plan-sync``'s owner line: with ``senders: owner`` it is what runs (all stages at once,
    in rounds); otherwise it says the ``[p2p]`` block runs. The rounds against the parts:
    ``test_one_session.py``."""
    from megarl.weight_sync.predict import (
        format_owner_prediction,
        predict_owner_senders,
    )

    trainer = TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    plan, placement = _moe_plan(trainer, EngineLayout(tensor_parallel_size=2), MOE)
    pred = predict_owner_senders(plan, placement, inter_gbps=50.0)
    assert pred.seconds >= pred.unpaced_s  # the rounds pace the stages; never faster than no pacing
    owner = format_owner_prediction(plan, pred, inter_gbps=50.0, senders="owner")[1]
    assert f"what runs (weight_sync.senders=owner), all stages at once in {pred.rounds} rounds] predicted " \
           f"{pred.seconds:.2f} s" in owner, owner
    other = format_owner_prediction(plan, pred, inter_gbps=50.0, senders="segment")[1]
    assert "not selected (weight_sync.senders=segment" in other and f"predicted {pred.seconds:.2f} s" in other


def test_megarl_validate_names_weight_sync_senders():
    """``weight_sync.senders`` is checked by ``megarl validate`` (``configs/base.yaml``): an unknown
    value and ``owner`` with another transport than ``p2p`` are refused naming the key."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from config_issues import validate_issues

    assert "weight_sync.senders" not in validate_issues(["weight_sync.senders=owner", "weight_sync.transport=p2p"])
    assert "weight_sync.senders" in validate_issues(["weight_sync.senders=owners"])
    issues = validate_issues(["weight_sync.senders=owner", "weight_sync.transport=distributed"])
    assert "needs weight_sync.transport=p2p" in issues["weight_sync.senders"], issues
