"""``megarl plan-sync`` for four MoE models on H100 clusters, on paper: bytes per link and per engine
rank and the predicted sync time of ``p2p`` and ``distributed``, with one and with four engines,
one sender per stage vs one per engine (``weight_sync.senders_per_stage``), BF16 and block-FP8 on
the wire, and ``p2p`` with segment senders (``weight_sync.senders: segment``: each engine rank's
segment from the trainer rank of the stage holding most of it; BF16 on the wire only). Metadata only (public
architecture numbers below); nothing is allocated.

Links: 200 GB/s NVLink and 50 GB/s network (400 Gb/s) per GPU, 8 GPUs per node (change with
``--intra-gbps`` / ``--inter-gbps``). The time model and what it leaves out:
:mod:`megarl.weight_sync.predict`.

usage: python tools/benchmarks/weight_sync_plan.py [--intra-gbps 200] [--inter-gbps 50] [--out table.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts_per_tok": 8, "head_dim": 128, "tie_word_embeddings": False,
             "vocab_size": 151936, "torch_dtype": "bfloat16"}
DEEPSEEK = {"model_type": "deepseek_v3", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_size": 7168, "num_hidden_layers": 61}
MODELS = {
    # name: (config.json metadata, trainer layout, engine TP, engine EP)
    "Qwen3-30B-A3B": (dict(QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                           num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768, num_experts=128),
                      dict(world=32, tensor_model_parallel_size=2, expert_model_parallel_size=8,
                           expert_tensor_parallel_size=1), 4, 4),
    "Qwen3-235B-A22B": (dict(QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                             num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536,
                             num_experts=128),
                        dict(world=128, tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                             expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                             num_layers_in_first_pipeline_stage=22, num_layers_in_last_pipeline_stage=24), 8, 8),
    "DeepSeek-V3": (dict(DEEPSEEK, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                         first_k_dense_replace=3, vocab_size=129280),
                    dict(world=256, tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                         expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                         num_layers_in_first_pipeline_stage=15, num_layers_in_last_pipeline_stage=16), 8, 8),
    "1T MoE (Kimi-K2 shape)": (dict(DEEPSEEK, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                                    first_k_dense_replace=1, vocab_size=163840),
                               dict(world=256, tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                                    expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                                    num_layers_in_first_pipeline_stage=15, num_layers_in_last_pipeline_stage=16),
                               8, 8),
}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The block-FP8 ``quantization_config`` of DeepSeek-V3's and Qwen3's FP8 releases."""


def rows(intra_gbps: float, inter_gbps: float) -> list[dict]:
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.models.fp8_blocks import parse_quantization_config
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.predict import predict_sync

    out = []
    for name, (config, trainer, engine_tp, engine_ep) in MODELS.items():
        sizes = dict(trainer)
        layout = TrainerLayout.from_world_size(sizes.pop("world"), **sizes)
        specs = param_specs_from_hf_config(config, tensor_model_parallel_size=layout.tp_size, dtype="bfloat16")
        hf_config = AutoConfig.for_model(**config)
        placement = Placement(get_family(hf_config).layout(hf_config, tp_size=layout.tp_size))
        for engines in (1, 4):
            for senders in (1, None):
                if engines == 1 and senders is None:
                    continue  # one engine: one sender per stage either way
                for wire in ("bf16", "fp8"):
                    quantization = parse_quantization_config(FP8, where="FP8") if wire == "fp8" else None
                    plan = build_plan(layout, EngineLayout(tensor_parallel_size=engine_tp,
                                                           expert_parallel_size=engine_ep,
                                                           num_engines=engines), specs, bucket_size_mb=1024,
                                      quantization=quantization, senders_per_stage=senders)
                    row = {"model": name, "trainer": f"TP{layout.tp_size} PP{layout.pp_size} EP{layout.ep_size} "
                           f"ETP{layout.etp_size} x{layout.world_size} GPUs", "engine": f"TP{engine_tp} EP{engine_ep}",
                           "engines": engines, "senders_per_stage": plan.senders_per_stage, "wire": wire,
                           "model_gb": plan.total_bytes / 1e9, "wire_gb": plan.wire_bytes / 1e9}
                    for transport in ("p2p", "distributed"):
                        p = predict_sync(plan, transport, ranks_per_node=8, intra_gbps=intra_gbps,
                                         inter_gbps=inter_gbps)
                        row[f"{transport}_s"] = p.seconds
                        row[f"{transport}_received_over_shard"] = max(
                            r / s for r, s in zip(p.engine_rank_bytes, p.engine_shard_bytes) if s)
                    # segment senders (weight_sync.senders: segment; BF16 on the wire only)
                    row["p2p_segments_s"] = predict_sync(plan, "p2p", ranks_per_node=8, intra_gbps=intra_gbps,
                                                         inter_gbps=inter_gbps, placement=placement).seconds
                    out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intra-gbps", type=float, default=200.0)
    parser.add_argument("--inter-gbps", type=float, default=50.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    table = rows(args.intra_gbps, args.inter_gbps)
    print("| model | trainer | engines | senders/stage | wire | p2p s | p2p s, segment senders | distributed s | "
          "received/shard p2p, distributed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} ({r['model_gb']:.0f} GB) | {r['trainer']} | {r['engines']} x {r['engine']} | "
              f"{r['senders_per_stage']} | {r['wire']} ({r['wire_gb']:.0f} GB) | {r['p2p_s']:.2f} | "
              f"{r['p2p_segments_s']:.2f} | {r['distributed_s']:.2f} | {r['p2p_received_over_shard']:.2f}, "
              f"{r['distributed_received_over_shard']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
