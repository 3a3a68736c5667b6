"""``megarl plan-sync``'s prediction against closed forms written out for a small dense model."""
import pytest

from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.predict import format_prediction, predict_sync

H, L, V, NH, NKV, HD, INTER = 64, 2, 256, 4, 2, 16, 128
DENSE = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L, "num_attention_heads": NH,
         "num_key_value_heads": NKV, "head_dim": HD, "intermediate_size": INTER, "vocab_size": V,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_bytes_per_link_and_time_match_closed_forms():
    specs = param_specs_from_hf_config(DENSE, tensor_model_parallel_size=2, dtype="bfloat16")
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2, data_parallel_size=2),
                      EngineLayout(tensor_parallel_size=2, num_engines=3), specs, senders_per_stage=1)
    # HF elements: per layer q, o [NH*HD, H]; k, v [NKV*HD, H]; gate, up, down [INTER, H]; 4 norms
    per_layer = 2 * NH * HD * H + 2 * NKV * HD * H + 3 * INTER * H + 2 * H + 2 * HD
    total = 2 * (L * per_layer + 2 * V * H + H)
    replicated = 2 * (L * (2 * H + 2 * HD) + H)  # norms: every engine rank gets them whole
    shard = (total - replicated) // 2 + replicated
    assert plan.total_bytes == total and plan.engine_shard_bytes() == [shard, shard]
    # trainer rank 1 (same node) sends its TP half of every split tensor to the sender, rank 0
    gather = (total - replicated) // 2
    p2p = predict_sync(plan, "p2p", ranks_per_node=8, intra_gbps=100, inter_gbps=10)
    dist = predict_sync(plan, "distributed", ranks_per_node=8, intra_gbps=100, inter_gbps=10)
    (stage,) = p2p.stages
    assert (stage.gather_intra_bytes, stage.gather_inter_bytes, stage.send_bytes) == (gather, 0, 3 * 2 * shard)
    assert p2p.seconds == pytest.approx(max(gather / 100e9, 6 * shard / 10e9))
    assert dist.stages[0].send_bytes == total and dist.seconds == pytest.approx(max(gather / 100e9, total / 10e9))
    assert p2p.engine_rank_bytes == [shard, shard] and dist.engine_rank_bytes == [total, total]
    # one rank per node: the gather crosses the network
    apart = predict_sync(plan, "p2p", ranks_per_node=1, intra_gbps=100, inter_gbps=10)
    assert (apart.stages[0].gather_intra_bytes, apart.stages[0].gather_inter_bytes) == (0, gather)
    text = format_prediction(plan, [p2p, dist], intra_gbps=100, inter_gbps=10)
    assert "[p2p]" in text and "received/shard 1.00" in text and "[distributed]" in text
    with pytest.raises(ValueError, match="p2p or distributed"):
        predict_sync(plan, "disk", ranks_per_node=8, intra_gbps=100, inter_gbps=10)


def test_replicas_send_side_by_side_to_their_own_engines():
    """DP2 x TP2 -> 3 engines: replica 0 (ranks 0, 1) serves engines 0 and 2, replica 1 (ranks 2, 3)
    engine 1; the stage takes the slower sender."""
    specs = param_specs_from_hf_config(DENSE, tensor_model_parallel_size=2, dtype="bfloat16")
    trainer = TrainerLayout(tensor_model_parallel_size=2, data_parallel_size=2)
    plan = build_plan(trainer, EngineLayout(tensor_parallel_size=2, num_engines=3), specs)
    assert plan.senders_per_stage == 2
    per_layer = 2 * NH * HD * H + 2 * NKV * HD * H + 3 * INTER * H + 2 * H + 2 * HD
    total = 2 * (L * per_layer + 2 * V * H + H)
    replicated = 2 * (L * (2 * H + 2 * HD) + H)
    shard = (total - replicated) // 2 + replicated
    gather = (total - replicated) // 2
    p2p = predict_sync(plan, "p2p", ranks_per_node=2, intra_gbps=100, inter_gbps=10)
    rows = [(s.replica, s.sender_rank, s.engines, s.gather_intra_bytes, s.gather_inter_bytes, s.send_bytes)
            for s in p2p.stages]
    assert rows == [(0, 0, 2, gather, 0, 2 * 2 * shard), (1, 2, 1, gather, 0, 2 * shard)]
    assert p2p.seconds == pytest.approx(max(gather / 100e9, 4 * shard / 10e9))
    dist = predict_sync(plan, "distributed", ranks_per_node=2, intra_gbps=100, inter_gbps=10)
    assert [s.send_bytes for s in dist.stages] == [total, total]
    # one sender per stage sends all three engines their shards over one link
    one = predict_sync(build_plan(trainer, EngineLayout(tensor_parallel_size=2, num_engines=3), specs,
                                  senders_per_stage=1), "p2p", ranks_per_node=2, intra_gbps=100, inter_gbps=10)
    assert one.seconds == pytest.approx(max(gather / 100e9, 6 * shard / 10e9))
    text = format_prediction(plan, [p2p, dist], intra_gbps=100, inter_gbps=10)
    assert "2 sender(s) per stage" in text


def test_segment_senders_send_each_engine_ranks_segment_from_the_trainer_rank_holding_it():
    """TP2 trainer -> one TP2 engine, ``p2p`` with segment senders: trainer rank k sends engine rank
    k's shard over its own link; rank 1 first gathers the norms (held by rank 0 only), rank 0
    gathers nothing; the stage takes the slower of the two (closed forms as above)."""
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.weight_sync.copy_instructions import Placement

    specs = param_specs_from_hf_config(DENSE, tensor_model_parallel_size=2, dtype="bfloat16")
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2), EngineLayout(tensor_parallel_size=2), specs)
    hf_config = AutoConfig.for_model(**DENSE)
    placement = Placement(get_family(hf_config).layout(hf_config, tp_size=2))
    per_layer = 2 * NH * HD * H + 2 * NKV * HD * H + 3 * INTER * H + 2 * H + 2 * HD
    total = 2 * (L * per_layer + 2 * V * H + H)
    replicated = 2 * (L * (2 * H + 2 * HD) + H)
    shard = (total - replicated) // 2 + replicated
    p2p = predict_sync(plan, "p2p", ranks_per_node=8, intra_gbps=100, inter_gbps=10, placement=placement)
    rows = [(s.sender_rank, s.hf_bytes, s.gather_intra_bytes, s.gather_inter_bytes, s.send_bytes) for s in p2p.stages]
    assert rows == [(0, shard, 0, 0, shard), (1, shard, replicated, 0, shard)]
    assert p2p.seconds == pytest.approx(max(replicated / 100e9, shard / 10e9))
    one = predict_sync(plan, "p2p", ranks_per_node=8, intra_gbps=100, inter_gbps=10)
    assert one.seconds == pytest.approx(max((total - replicated) / 2 / 100e9, 2 * shard / 10e9))
