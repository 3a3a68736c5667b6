"""Owner senders on paper (``megarl.weight_sync.senders``): every part leaves a trainer rank that holds
it (checked with Megatron's own ``RankGenerator``), each engine rank receives exactly its slices,
and on the shipped GPU recipes the prediction is within 1.25x the physical bound, whose bytes are
counted here independently from the recipes' ``config.json`` shapes."""
import json
import math
from pathlib import Path

import pytest

from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.senders import assign_senders

REPO = Path(__file__).resolve().parents[3]
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
       "vocab_size": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
       "mlp_only_layers": []}
MLA = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
       "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "intermediate_size": 96,
       "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
       "first_k_dense_replace": 1, "topk_method": "noaux_tc", "vocab_size": 256, "tie_word_embeddings": False,
       "torch_dtype": "bfloat16", "n_group": 1, "topk_group": 1}


def megatron_coords(layout: TrainerLayout) -> dict[int, dict[str, int]]:
    """rank -> its position in Megatron's own tp / pp / ep / etp groups (``RankGenerator``)."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp_size, ep=1, dp=layout.data_parallel_size, pp=layout.pp_size,
                          cp=layout.context_parallel_size, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=layout.etp_size, ep=layout.ep_size, dp=layout.expert_data_parallel_size,
                           pp=layout.pp_size, cp=1, order="tp-cp-ep-dp-pp")
    coords: dict[int, dict[str, int]] = {r: {} for r in range(layout.world_size)}
    for gen, token, key in ((dense, "tp", "tp"), (dense, "pp", "pp"), (expert, "tp", "etp"), (expert, "ep", "ep")):
        for group in gen.get_ranks(token):
            for pos, r in enumerate(group):
                coords[r][key] = pos
    return coords


def holds(coords, plan, transfer, shard_index: int, rank: int) -> bool:
    """Whether trainer ``rank`` holds shard ``shard_index`` of ``transfer`` (Megatron's coordinates)."""
    c, p, t = coords[rank], transfer.param, plan.trainer_layout
    if c["pp"] != transfer.pp_rank:
        return False
    if p.expert is not None:
        ep_ok = c["ep"] == p.expert // (plan.num_experts // t.ep_size)
        return ep_ok and (p.tp_axis is None or t.etp_size == 1 or c["etp"] == shard_index)
    return p.tp_axis is None or t.tp_size == 1 or c["tp"] == shard_index


def _moe_plan(trainer: TrainerLayout, engines: EngineLayout, config: dict = MOE):
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.weight_sync.copy_instructions import Placement

    specs = param_specs_from_hf_config(config, tensor_model_parallel_size=trainer.tp_size, dtype="bfloat16")
    plan = build_plan(trainer, engines, specs, bucket_size_mb=0.01)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = config["architectures"]
    return plan, Placement(get_family(hf_config).layout(hf_config, tp_size=trainer.tp_size))


@pytest.mark.parametrize("trainer, engines, config", [
    # DeepSeek-V3's shape: one expert-data-parallel copy, experts over every trainer rank, engines of TP2
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=2, num_engines=2), MOE),
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=2, expert_parallel_size=2, num_engines=2),
     MLA),
    # two copies of everything, three engines, engine TP wider than the trainer's
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2, data_parallel_size=2,
                   expert_tensor_parallel_size=1), EngineLayout(tensor_parallel_size=4, num_engines=3), MOE),
    # PP2 x ETP2: stages and expert tensor shards
    (TrainerLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                   data_parallel_size=2), EngineLayout(tensor_parallel_size=2, num_engines=2), MOE),
])
def test_every_part_leaves_a_rank_holding_it_and_every_engine_rank_gets_its_slices(trainer, engines, config):
    plan, placement = _moe_plan(trainer, engines, config)
    sends = assign_senders(plan, placement)
    coords = megatron_coords(trainer)
    transfers = {t.param.name: t for b in plan.buckets for t in b.params}
    for (name, shard, _engine, _rank), sender in sends.assignment.items():
        assert holds(coords, plan, transfers[name], shard, sender), (name, shard, sender)
    shard_bytes = plan.engine_shard_bytes()
    assert sends.received == [shard_bytes] * engines.num_engines
    assert sum(sends.sent.values()) == engines.num_engines * sum(shard_bytes)
    held = {r: sum(s.nbytes for t in transfers.values() for s in t.sources
                   if holds(coords, plan, t, s.shard_index, r)) for r in range(trainer.world_size)}
    assert sends.shard == held
    for rank, nbytes in sends.sent.items():
        assert nbytes <= held[rank] * engines.num_engines, rank
    if trainer.expert_data_parallel_size == 1:  # every expert part leaves its one EP owner
        experts = [s for (n, *_), s in sends.assignment.items() if transfers[n].param.expert is not None]
        assert experts and len(set(experts)) == trainer.world_size


def _fp8(rows: int, cols: int) -> int:
    """Bytes of a block-FP8 weight slice and its fp32 128 x 128 scale blocks."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4


def mla_rank_bytes(c: dict, tp: int, ep: int) -> int:
    """Engine rank 0's bytes of a block-FP8 DeepSeek-V3-class model (SGLang's splits, written out)."""
    h, nh, moe_tp = c["hidden_size"], c["num_attention_heads"], tp // ep
    q, kv, rope, nope, v = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    attn = 2 * h * 2 + q * 2 + kv * 2 + _fp8(q, h) + _fp8(kv + rope, h) + _fp8(nh * (nope + rope) // tp, q) \
        + _fp8(nh * (nope + v) // tp, kv) + _fp8(h, nh * v // tp)
    dense = 2 * _fp8(c["intermediate_size"] // tp, h) + _fp8(h, c["intermediate_size"] // tp)
    e, mi, si = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
    moe = e * h * 2 + e * 4 + 2 * _fp8(si // tp, h) + _fp8(h, si // tp) \
        + e // ep * (2 * _fp8(mi // moe_tp, h) + _fp8(h, mi // moe_tp))
    k, layers = c["first_k_dense_replace"], c["num_hidden_layers"]
    return 2 * (c["vocab_size"] // tp) * h * 2 + h * 2 + layers * attn + k * dense + (layers - k) * moe


def qwen3_moe_rank_bytes(c: dict, tp: int, ep: int) -> int:
    """Engine rank 0's bytes of a BF16 Qwen3-MoE model (SGLang's splits, written out)."""
    h, hd, nh, nkv, moe_tp = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], tp // ep
    kv_rows = nkv * hd // tp if nkv >= tp else hd
    layer = nh * hd // tp * h * 2 + 2 * kv_rows * h + 2 * hd + 2 * h + c["num_experts"] * h \
        + c["num_experts"] // ep * 3 * (c["moe_intermediate_size"] // moe_tp) * h
    return 2 * (2 * (c["vocab_size"] // tp) * h + h + c["num_hidden_layers"] * layer)


def minimax_m2_rank_bytes(c: dict, tp: int, ep: int) -> int:
    """Engine rank 0's bytes of a BF16 MiniMax-M2 model (SGLang's splits, written out): as Qwen3-MoE's, but
    the q/k norms hold the rank's heads (``MiniMaxM2RMSNormTP``), the experts are ``intermediate_size``
    wide and each layer has an fp32 router bias."""
    h, hd, nh, nkv, moe_tp = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], tp // ep
    kv_rows, e = (nkv * hd // tp if nkv >= tp else hd), c["num_local_experts"]
    layer = nh * hd // tp * h * 2 + 2 * kv_rows * h + nh * hd // tp + kv_rows + 2 * h + e * h \
        + e // ep * 3 * (c["intermediate_size"] // moe_tp) * h
    return 2 * (2 * (c["vocab_size"] // tp) * h + h + c["num_hidden_layers"] * layer) + 4 * e * c["num_hidden_layers"]


def gpt_oss_rank_bytes(c: dict, tp: int, ep: int) -> int:
    """Engine rank 0's bytes of a BF16 gpt-oss model (engine EP 1; SGLang's splits, written out): the
    sinks and the o_proj / experts' down biases whole, each expert stack's 2F / F axis over TP."""
    h, hd, nh, nkv, e, f = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                            c["num_local_experts"], c["intermediate_size"])
    kv_rows = nkv * hd // tp if nkv >= tp else hd
    attn = (nh * hd // tp + 2 * kv_rows) * (h + 1) + h * nh * hd // tp + h + nh
    experts = e * h * 2 * f // tp + e * 2 * f // tp + e * f // tp * h + e * h
    layer = 2 * h + attn + e * (h + 1) + experts
    return 2 * (2 * (c["vocab_size"] // tp) * h + h + c["num_hidden_layers"] * layer)


RECIPES = {"qwen3_30b_a3b_gpu": qwen3_moe_rank_bytes, "qwen3_235b_a22b_gpu": qwen3_moe_rank_bytes,
           "glm45_gpu": None, "deepseek_v3_gpu": mla_rank_bytes, "kimi_k2_gpu": mla_rank_bytes,
           "kimi_k25_gpu": None, "minimax_m2_gpu": minimax_m2_rank_bytes, "gpt_oss_120b_gpu": gpt_oss_rank_bytes,
           "qwen3_5_397b_a17b_gpu": None}
"""Every ``configs/*_gpu.yaml`` (checked below) and, where written, the bound's bytes from config.json alone."""


def test_every_shipped_gpu_recipe_is_checked_against_the_bound():
    assert sorted(RECIPES) == sorted(p.stem for p in (REPO / "configs").glob("*_gpu.yaml"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_shipped_recipes_sync_within_the_physical_bound(recipe, monkeypatch):
    """Each shipped GPU recipe on paper (7-100 s each on this loaded 2-core machine: plans of 0.06-2 TB models).

    What runs, paced round by round (``seconds``: one vote per round, each as long as its busiest
    link), is within 1.25x the bound (issue 34 part 1); so is the busiest link over the whole sync
    (``unpaced_s``), which pacing never beats."""
    from megarl.cli import prepare_config
    from megarl.weight_sync.owner_predict import predict_owner_senders
    from megarl.weight_sync.predict import link_speeds, placement_from_config, plan_from_config

    monkeypatch.delenv("MEGARL_MODEL_DIR", raising=False)
    cfg = prepare_config(str(REPO / "configs" / f"{recipe}.yaml"), [])
    plan = plan_from_config(cfg, senders="owner")  # owner senders' plan: each layer's experts spread
    _, inter, _ = link_speeds(cfg)
    pred = predict_owner_senders(plan, placement_from_config(cfg), inter_gbps=inter)
    assert pred.unpaced_s <= pred.seconds <= 1.25 * pred.bound_s, (recipe, pred.seconds / pred.bound_s)
    print(f"\n{recipe}: bound {pred.bound_s:.2f} s, owner senders as they run (paced, {pred.rounds} rounds) "
          f"{pred.seconds:.2f} s = {pred.seconds / pred.bound_s:.2f} x, unpaced {pred.unpaced_s:.2f} s")
    engines = plan.engine_layout.num_engines
    assert all(pred.sends.sent.get(r, 0) <= n * engines for r, n in pred.sends.shard.items())
    count = RECIPES[recipe]
    config = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    extra = 0  # MLA's down projections off the FP8 blocks at trainer TP8 arrive in BF16 (senders.receiver_quantized)
    if plan.quantization is not None:
        h, tp = config["hidden_size"], plan.trainer_layout.tp_size
        for rows in (config["q_lora_rank"], config["kv_lora_rank"] + config["qk_rope_head_dim"]):
            if rows // tp % 128:  # replicated on every engine rank: BF16 bytes instead of FP8 + scales
                extra += config["num_hidden_layers"] * (rows * h - 4 * -(-rows // 128) * -(-h // 128))
    assert pred.sends.received == [[n + extra for n in plan.engine_shard_bytes()]] * engines
    if count is not None:  # the bound's bytes, counted from config.json alone
        assert pred.bound_bytes == count(config, plan.engine_layout.tp_size, plan.engine_layout.ep_size)
    if plan.quantization is not None:  # MLA's down projections split off 128-row blocks over TP8
        tp = plan.trainer_layout.tp_size
        split = {"q_a_proj": config["q_lora_rank"], "kv_a_proj_with_mqa": config["kv_lora_rank"] + config["qk_rope_head_dim"]}
        expected = {f"model.layers.{i}.self_attn.{k}.weight" for i in range(config["num_hidden_layers"])
                    for k, rows in split.items() if rows // tp % 128}
        assert {u.split()[0] for u in pred.unaligned} == expected


def test_plan_sync_reads_the_links_of_the_cluster_gpu_preset_megarl_plan_reads():
    from types import SimpleNamespace

    from megarl.errors import UserError
    from megarl.plan.gpus import GPUS
    from megarl.weight_sync.predict import link_speeds

    cfg = SimpleNamespace(cluster=SimpleNamespace(gpu="b200"))
    assert link_speeds(cfg)[:2] == (GPUS["b200"].nvlink_gbps, GPUS["b200"].network_gbps)
    assert link_speeds(cfg, gpu="h100")[:2] == (GPUS["h100"].nvlink_gbps, GPUS["h100"].network_gbps)
    assert link_speeds(cfg, inter_gbps=7.0)[:2] == (GPUS["b200"].nvlink_gbps, 7.0)
    none = SimpleNamespace(cluster=SimpleNamespace(gpu=None))
    assert link_speeds(none, intra_gbps=1.0, inter_gbps=2.0) == (1.0, 2.0, "given")
    with pytest.raises(UserError, match="cluster.gpu"):
        link_speeds(none)  # no CUDA device here to detect
    with pytest.raises(UserError, match="cluster.gpu: unknown GPU"):
        link_speeds(none, gpu="a100")


@pytest.mark.parametrize("config, engines", [
    (MOE, EngineLayout(tensor_parallel_size=4, num_engines=2)),
    (MLA, EngineLayout(tensor_parallel_size=2, expert_parallel_size=2, num_engines=2))], ids=["qwen3_moe", "mla"])
def test_owner_parts_rebuild_every_engine_rank_slice_from_the_senders_own_shards(config, engines):
    """Real tensors, no processes: random Megatron parameters split with the family's ``split_tp``;
    each assigned sender cuts its parts from its own shard (``owner_part``); every engine rank's
    slices, put together, equal the family's ``to_hf`` of the whole parameter sliced as SGLang
    holds it, and the bytes each trainer rank cut equal the plan's ``sent``."""
    import torch

    from megarl.models.mapping import lookup, split_tp, to_hf
    from megarl.weight_sync.senders import owner_part
    from megarl.weight_sync.specs import torch_dtype

    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                            data_parallel_size=2)  # one expert-data-parallel copy, as DeepSeek-V3's recipe
    plan, placement = _moe_plan(trainer, engines, config)
    sends = assign_senders(plan, placement)
    torch.manual_seed(0)
    got, want, cut = {}, {}, {}
    for bucket in plan.buckets:
        for transfer in bucket.params:
            entry, _ = lookup(placement.table, transfer.param.name)
            full = torch.randn(transfer.param.shape).to(torch_dtype(transfer.param.dtype))
            n = len(transfer.sources)
            shards = [split_tp(full, entry.tp_split, s.shard_index, n) for s in transfer.sources]
            for spec, tensor in zip(transfer.param.hf, to_hf(entry, full, placement.layout)):
                for rank, sl in plan.engine_slices_of(spec).items():
                    ref = tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)
                    for engine in range(engines.num_engines):
                        want[(engine, rank, spec.name)] = ref
                        got[(engine, rank, spec.name)] = torch.full_like(ref, float("nan"))
            for piece in placement.pieces(transfer):
                spec, source = transfer.param.hf[piece.hf_index], transfer.sources[piece.shard]
                for rank, sl in plan.engine_slices_of(spec).items():
                    view, axis, at = owner_part(spec, sl, piece, shards[piece.shard])
                    if view is None:
                        continue
                    for engine in range(engines.num_engines):
                        sender = sends.assignment[(transfer.param.name, source.shard_index, engine, rank)]
                        cut[sender] = cut.get(sender, 0) + view.numel() * view.element_size()
                        got[(engine, rank, spec.name)].narrow(axis, at, view.shape[axis]).copy_(view)
    assert got.keys() == want.keys()
    for key, ref in want.items():
        assert torch.equal(got[key], ref), key
    assert cut == sends.sent
