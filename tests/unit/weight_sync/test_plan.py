"""Weight-sync plans from metadata, checked against Megatron's own rank/layer math and closed forms.

Big layouts (Qwen3-235B-A22B- and DeepSeek-V3-shaped metadata, trainer TP8 x PP4 x EP16, engines
TP8 / TP16 with EP) cannot run here; their plans are property-tested: every HF tensor is delivered
exactly once per engine, no trainer rank sends a shard it does not hold (checked with Megatron's
``RankGenerator`` and ``get_transformer_layer_offset``), and bytes add up.
"""
import functools
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.weight_sync.engine_slices import PlanError, engine_slices, sglang_padded_vocab
from megarl.weight_sync.layout import EngineLayout, LayoutError, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.specs import EngineSplit, SpecError

sys.path.insert(0, str(Path(__file__).parent))
from big_configs import DEEPSEEK_V3, QWEN3_235B_A22B

MCORE_ORDER = "tp-cp-ep-dp-pp"


@functools.cache
def megatron_coords(layout: TrainerLayout) -> dict[int, dict[str, int]]:
    """rank -> {tp, pp, etp, ep}: the position of the rank in each of Megatron's own groups."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp_size, ep=1, dp=layout.data_parallel_size, pp=layout.pp_size,
                          cp=layout.context_parallel_size, order=MCORE_ORDER)
    expert = RankGenerator(tp=layout.etp_size, ep=layout.ep_size, dp=layout.expert_data_parallel_size,
                           pp=layout.pp_size, cp=1, order=MCORE_ORDER)
    coords: dict[int, dict[str, int]] = {r: {} for r in range(layout.world_size)}
    for gen, token, key in ((dense, "tp", "tp"), (dense, "pp", "pp"), (dense, "dp", "dp"), (dense, "cp", "cp"),
                            (expert, "tp", "etp"), (expert, "ep", "ep"), (expert, "dp", "edp")):
        for group in gen.get_ranks(token):
            for pos, r in enumerate(group):
                coords[r][key] = pos
    return coords


@functools.cache
def megatron_layer_ranges(layout: TrainerLayout, num_layers: int) -> dict[tuple[int, int], range]:
    """(pp_rank, vp_rank) -> global layers, from Megatron's get_transformer_layer_offset."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=layout.pp_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=layout.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=layout.num_layers_in_last_pipeline_stage)
    vp_stages = range(layout.vpp_size) if layout.virtual_pipeline_model_parallel_size else [None]
    out = {}
    for pp in range(layout.pp_size):
        for vp in vp_stages:
            start = get_transformer_layer_offset(cfg, vp, pp)
            out[(pp, vp or 0)] = range(start, start + get_num_layers_to_build(cfg, vp, pp))
    return out


def expected_multiplicity(tensor, engine: EngineLayout) -> int:
    """How many ranks of one engine hold each element of ``tensor`` (SGLang semantics, written here)."""
    if tensor.expert is not None:
        return 1
    if tensor.engine_split is EngineSplit.REPLICATED:
        return engine.tp_size
    if tensor.engine_split is EngineSplit.KV_HEADS:
        return max(1, engine.tp_size // (tensor.shape[0] // tensor.head_dim))
    return 1


def check_plan(plan, specs, num_layers: int) -> None:
    layout, engine = plan.trainer_layout, plan.engine_layout
    coords = megatron_coords(layout)
    layers = megatron_layer_ranges(layout, num_layers) if num_layers else {}
    by_name = {p.name: p for p in specs if p.hf}
    seen_params, hf_names = Counter(), Counter()
    gathered = 0
    for b in plan.buckets:
        assert coords[b.sender_rank] == dict(tp=0, pp=b.pp_rank, dp=0, cp=0, etp=0, ep=0, edp=0)
        # over its size only to hold one unit: a parameter, or an engine load group kept whole
        units = {t.param.load_group or t.param.name for t in b.params}
        assert b.nbytes <= plan.bucket_size_bytes or len(units) == 1
        sizes = [t.itemsize for t in b.hf_tensors]
        assert sizes == sorted(sizes, reverse=True)
        for t in b.params:
            p = t.param
            seen_params[p.name] += 1
            hf_names.update(h.name for h in p.hf)
            if p.layer is not None:
                assert p.layer in layers[(t.pp_rank, t.vp_rank)], (p.name, t.pp_rank, t.vp_rank)
            expected_shards = (layout.etp_size if p.expert is not None else layout.tp_size) if p.tp_axis is not None else 1
            assert [s.shard_index for s in t.sources] == list(range(expected_shards))
            for s in t.sources:  # no rank sends what it does not hold
                c = coords[s.trainer_rank]
                assert c["pp"] == b.pp_rank
                if p.expert is not None:
                    assert c["etp"] == s.shard_index and c["edp"] == 0
                    assert c["ep"] == p.expert // (plan.num_experts // layout.ep_size)
                else:
                    assert c["tp"] == s.shard_index and c["dp"] == 0 and c["cp"] == 0
                gathered += s.nbytes
    assert set(seen_params) == set(by_name) and max(seen_params.values()) == 1
    check_replicas(plan, coords)
    assert max(hf_names.values()) == 1
    # bytes add up: gathered Megatron bytes == model bytes; HF bytes == model bytes - vocab padding
    assert gathered == sum(p.nbytes for p in by_name.values())
    hf_total = sum(h.nbytes for p in specs for h in p.hf)
    assert plan.total_bytes == hf_total == sum(b.nbytes for b in plan.buckets)
    # every HF tensor delivered exactly once per engine (shard transport)
    per_rank = [0] * engine.tp_size
    for i, tensor in enumerate(plan.hf_tensors()):
        received = engine_slices(tensor, engine, plan.num_experts)
        if i % 97 == 0:  # the per-rank accessor agrees (sampled: it is the same function per rank)
            assert {r: plan.engine_slice(tensor, r) for r in range(engine.tp_size)
                    if plan.engine_slice(tensor, r) is not None} == received
        if tensor.expert is not None:  # only the ranks of the expert's EP rank (SGLang's moe_ep_rank)
            per_ep = plan.num_experts // engine.ep_size
            assert {r // (engine.tp_size // engine.ep_size) for r in received} == {tensor.expert // per_ep}
        slices = Counter()
        for r, sl in received.items():
            axis_len = tensor.shape[sl.axis] if sl.axis is not None else 1
            slices[(sl.axis, sl.start, sl.stop if sl.axis is not None else axis_len)] += 1
            per_rank[r] += tensor.nbytes * ((sl.stop - sl.start) if sl.axis is not None else 1) // axis_len
        m = expected_multiplicity(tensor, engine)
        assert set(slices.values()) == {m}, (tensor.name, slices, m)
        pos = 0
        for _, start, stop in sorted(slices):
            assert start == pos
            pos = stop
        axis = next(iter(slices))[0]
        assert pos == (tensor.shape[axis] if axis is not None else 1), tensor.name
    assert per_rank == plan.engine_shard_bytes() == plan.engine_rank_bytes("shard")
    assert sum(per_rank) == sum(t.nbytes * expected_multiplicity(t, engine) for t in plan.hf_tensors())
    assert plan.engine_rank_bytes("distributed") == [hf_total] * engine.tp_size


def check_replicas(plan, coords) -> None:
    """Every replica's plan sends the same shards from ranks that hold them (Megatron's groups),
    and no rank works for two replicas; replica k serves the engines i % R == k."""
    layout = plan.trainer_layout
    owners: dict[int, int] = {}
    for k in range(plan.senders_per_stage):
        replica = plan.for_replica(k)
        assert replica.engines == tuple(i for i in range(plan.engine_layout.num_engines)
                                        if i % plan.senders_per_stage == k)
        for b0, b in zip(plan.buckets, replica.buckets):
            c = coords[b.sender_rank]
            assert (c["tp"], c["pp"], c["etp"], c["ep"]) == (0, b.pp_rank, 0, 0)
            for t0, t in zip(b0.params, b.params):
                assert t0.param is t.param
                for s0, s in zip(t0.sources, t.sources, strict=True):
                    assert s.shard_index == s0.shard_index and s.shape == s0.shape
                    c = coords[s.trainer_rank]
                    assert c["pp"] == b.pp_rank
                    if t.param.expert is not None:
                        assert (c["etp"], c["ep"]) == (s.shard_index, t.param.expert // (plan.num_experts // layout.ep_size))
                    else:
                        assert c["tp"] == s.shard_index
                    assert owners.setdefault(s.trainer_rank, k) == k, "a rank works for two replicas"
            assert owners.setdefault(b.sender_rank, k) == k
    assert plan.senders_per_stage <= plan.engine_layout.num_engines


BIG = {  # config, trainer TP, layers on the first / last of 4 pipeline stages (uneven: 94 and 61 layers)
    # Qwen3-235B-A22B has 4 query groups: Megatron cannot split its attention over TP 8 (see
    # test_qwen3_235b_at_tp8_is_a_named_error), so its trainer is TP4 x PP4 x EP16 (x ETP).
    "qwen3_235b": (QWEN3_235B_A22B, 4, 22, 24),
    "deepseek_v3": (DEEPSEEK_V3, 8, 15, 16),
}


@functools.cache
def big_specs(name: str):
    return tuple(param_specs_from_hf_config(BIG[name][0], tensor_model_parallel_size=BIG[name][1]))


def big_trainer(name: str, etp: int) -> TrainerLayout:
    _, tp, first, last = BIG[name]
    return TrainerLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=4, expert_model_parallel_size=16,
                         expert_tensor_parallel_size=etp, data_parallel_size=128 // tp,
                         num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)


def test_qwen3_235b_at_tp8_is_a_named_error():
    specs = param_specs_from_hf_config(QWEN3_235B_A22B, tensor_model_parallel_size=8)
    with pytest.raises(SpecError, match="linear_qkv.*query groups divisible by TP"):
        build_plan(TrainerLayout(tensor_model_parallel_size=8, data_parallel_size=2), EngineLayout(), specs)


@pytest.mark.timeout(240)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from(sorted(BIG)), etp=st.sampled_from([1, 2]),
       engine=st.sampled_from([(8, 1), (8, 8), (16, 16), (16, 8)]))
def test_big_layouts_deliver_every_tensor_once_from_its_holders(model, etp, engine):
    specs = big_specs(model)
    plan = build_plan(big_trainer(model, etp), EngineLayout(tensor_parallel_size=engine[0],
                                                            expert_parallel_size=engine[1], num_engines=4), specs)
    check_plan(plan, specs, BIG[model][0]["num_hidden_layers"])


def qwen3_235b_rank_bytes_closed_form(tp: int, ep: int) -> int:
    """Bytes of one engine rank's weights of Qwen3-235B-A22B in SGLang, from the architecture numbers."""
    c = QWEN3_235B_A22B
    h, nh, nkv, hd, e, i, v, n = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "num_experts", "moe_intermediate_size",
                                                  "vocab_size", "num_hidden_layers"))
    kv_heads = max(1, nkv // tp)
    attn = (nh // tp) * hd * h * 2 + 2 * kv_heads * hd * h + 2 * hd
    moe = (e // ep) * 3 * h * i // (tp // ep) + e * h
    return 2 * (n * (attn + moe + 2 * h) + 2 * (v // tp) * h + h)


@pytest.mark.parametrize("engine", [(8, 1), (16, 16), (16, 4)])
def test_engine_shard_bytes_match_closed_form(engine):
    plan = build_plan(big_trainer("qwen3_235b", 1), EngineLayout(tensor_parallel_size=engine[0],
                                                                 expert_parallel_size=engine[1]),
                      big_specs("qwen3_235b"))
    assert plan.engine_shard_bytes() == [qwen3_235b_rank_bytes_closed_form(*engine)] * engine[0]
    assert plan.engine_rank_bytes("shard") == plan.engine_shard_bytes()


@st.composite
def small_case(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    ep = draw(st.sampled_from([1, 2, 4]))
    etp = draw(st.sampled_from([None, 1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    layers = pp * (vpp or 1) * draw(st.integers(1, 2))
    experts = 8 * draw(st.integers(1, 2))
    family = draw(st.sampled_from(["qwen3_moe", "qwen3", "deepseek_v3"]))
    cfg = {"model_type": family, "hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 8,
           "num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 4, 8) if k % tp == 0])), "head_dim": 8, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_experts": experts, "vocab_size": draw(st.sampled_from([1000, 1024])),
           "tie_word_embeddings": draw(st.booleans()), "q_lora_rank": 16, "kv_lora_rank": 8,
           "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": experts,
           "n_shared_experts": 1, "first_k_dense_replace": 1, "torch_dtype": "float32"}
    engine_tp = draw(st.sampled_from([1, 2, 4, 8]))
    engine_ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if engine_tp % e == 0]))
    engines = draw(st.sampled_from([1, 2, 3, 5]))
    return cfg, engines, dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                     expert_tensor_parallel_size=etp, data_parallel_size=dp * (ep * (etp or tp)),
                     context_parallel_size=cp), (engine_tp, engine_ep)


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None)
@given(case=small_case(), bucket_mb=st.sampled_from([0.001, 0.01, 512]))
def test_random_small_layouts(case, bucket_mb):
    cfg, engines, trainer, (engine_tp, engine_ep) = case
    layout = TrainerLayout(**trainer)
    specs = param_specs_from_hf_config(cfg, tensor_model_parallel_size=layout.tp_size)
    engine = EngineLayout(tensor_parallel_size=engine_tp, expert_parallel_size=engine_ep, num_engines=engines)
    if engine_tp > 1 and cfg["vocab_size"] != sglang_padded_vocab(cfg["vocab_size"], engine_tp):
        with pytest.raises(PlanError, match="vocabulary"):
            build_plan(layout, engine, specs, bucket_size_mb=bucket_mb).engine_shard_bytes()
        return
    plan = build_plan(layout, engine, specs, bucket_size_mb=bucket_mb)
    check_plan(plan, specs, cfg["num_hidden_layers"])


def test_megatron_vocab_padding_is_the_only_difference_between_megatron_and_hf_bytes():
    cfg = dict(QWEN3_235B_A22B)
    specs = param_specs_from_hf_config(cfg, tensor_model_parallel_size=8)  # metadata only: no TP check here
    megatron_bytes = sum(p.nbytes for p in specs)
    hf_bytes = sum(t.nbytes for p in specs for t in p.hf)
    padded = -(-cfg["vocab_size"] // 1024) * 1024
    assert megatron_bytes - hf_bytes == 2 * (padded - cfg["vocab_size"]) * cfg["hidden_size"] * 2


def test_bad_inputs_are_named_errors():
    small = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 256}
    specs = param_specs_from_hf_config(small)
    with pytest.raises(LayoutError, match="num_layers 3"):
        build_plan(TrainerLayout(pipeline_model_parallel_size=2), EngineLayout(), specs)
    with pytest.raises(SpecError, match="does not split"):
        build_plan(TrainerLayout(tensor_model_parallel_size=8), EngineLayout(), specs)
    with pytest.raises(PlanError, match="duplicate"):
        build_plan(TrainerLayout(), EngineLayout(), specs + specs[:1])
    with pytest.raises(PlanError, match="bucket_size_mb"):
        build_plan(TrainerLayout(), EngineLayout(), specs, bucket_size_mb=0)
    with pytest.raises(PlanError, match="senders_per_stage"):
        build_plan(TrainerLayout(), EngineLayout(), specs, senders_per_stage=0)
    with pytest.raises((SpecError, ValueError), match="llama4"):
        param_specs_from_hf_config({**small, "model_type": "llama4"})
    with pytest.raises(SpecError, match="model_type"):
        param_specs_from_hf_config({k: v for k, v in small.items() if k != "model_type"})
    with pytest.raises(LayoutError, match="expert_parallel_size"):
        EngineLayout(tensor_parallel_size=2, expert_parallel_size=4)


def test_senders_per_stage_is_bounded_by_engines_copies_and_the_config():
    """R = min(complete copies of a stage, engines, senders_per_stage): TP2 x EP4 (ETP1) x DP4 on
    8 ranks per stage holds lcm(2, 4) = 4 ranks per copy: 2 copies."""
    small = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
             "num_experts": 8, "vocab_size": 256}
    specs = param_specs_from_hf_config(small, tensor_model_parallel_size=2)
    layout = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                           data_parallel_size=4, pipeline_model_parallel_size=2)
    assert (layout.replica_block, layout.replicas_per_stage) == (4, 2)
    assert [layout.replica_of(r) for r in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    for engines, cap, expected in ((1, None, 1), (2, None, 2), (5, None, 2), (5, 1, 1)):
        plan = build_plan(layout, EngineLayout(num_engines=engines), specs, senders_per_stage=cap)
        assert plan.senders_per_stage == expected
    plan = build_plan(layout, EngineLayout(num_engines=5), specs)
    assert [plan.for_replica(k).engines for k in range(2)] == [(0, 2, 4), (1, 3)]
    assert {b.sender_rank for b in plan.for_replica(1).buckets} == {4, 12}
    with pytest.raises(PlanError, match="out of range"):
        plan.for_replica(2)


@pytest.mark.parametrize("bucket_mb", [64, 512])
def test_each_stages_buckets_ramp_up_then_down(bucket_mb):
    """Qwen3-235B-shaped, PP4: within a stage the first bucket holds at most 1/8 of the bucket size
    (unless one parameter is larger), the k-th at most 2**k / 8 of it up to the full size, the last is
    small again, and every HF tensor travels exactly once (the ramp moves boundaries, nothing else)."""
    from megarl.weight_sync.plan import MIB, RAMP_STEPS

    specs = param_specs_from_hf_config(QWEN3_235B_A22B, tensor_model_parallel_size=4)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                                    expert_model_parallel_size=16, data_parallel_size=32,
                                    num_layers_in_first_pipeline_stage=22, num_layers_in_last_pipeline_stage=24),
                      EngineLayout(tensor_parallel_size=8), specs, bucket_size_mb=bucket_mb)
    limit, floor = bucket_mb * MIB, (bucket_mb * MIB) >> RAMP_STEPS
    for stage in range(4):
        sizes = [b.nbytes for b in plan.buckets if b.pp_rank == stage]
        largest_param = max(sum(h.nbytes for h in t.param.hf) for b in plan.buckets if b.pp_rank == stage
                            for t in b.params)
        assert len(sizes) > 2 * RAMP_STEPS
        assert sizes[0] <= max(floor, largest_param)
        assert max(sizes) <= max(limit, largest_param) and max(sizes) > limit // 2
        assert all(size <= max(limit >> (RAMP_STEPS - k), largest_param) for k, size in enumerate(sizes[:RAMP_STEPS]))
        assert sizes[-1] <= max(floor, largest_param)
    names = [t.name for b in plan.buckets for t in b.hf_tensors]
    assert len(names) == len(set(names)) == sum(len(p.hf) for p in specs)
