"""Weight-sync plan of MiniMax-M2 against SGLang 0.5.23's own loaders.

MiniMax-M2 keeps its experts under ``block_sparse_moe.experts.{E}.w1/w3/w2`` and its q/k norms over all
heads split by heads over the engine's TP ranks (``MiniMaxM2RMSNormTP``). References: Qwen3-MoE's plan
(the same Megatron model, experts under ``mlp.experts.{E}``) for the experts; SGLang's own
``MiniMaxM2RMSNormTP.weight_loader``, run on a parameter of each engine rank's shape, for the rows a
rank holds, and the same loader on the plan's pre-sharded slice with and without megarl's
``sglang_compat.presharded_tp_norm_fix``. The end-to-end sync with the load proof on a real SGLang CPU
engine is ``tests/integration/weight_sync/test_load_proof.py``.
"""
from __future__ import annotations

import json

import pytest

from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.specs import EngineSplit

pytestmark = pytest.mark.timeout(120)

HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 8, 2, 4, 4
CONFIG = {"model_type": "minimax_m2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": HEADS,
          "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 16,
          "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "vocab_size": 1024, "rotary_dim": 2,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
          "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
          "torch_dtype": "float32"}
QWEN = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "moe_intermediate_size": 16, "num_experts": EXPERTS,
        "num_experts_per_tok": 2, "vocab_size": 1024, "decoder_sparse_step": 1, "torch_dtype": "float32"}
ATTN = "model.layers.1.self_attn."


def _hf(config: dict) -> dict:
    return {t.name: t for p in param_specs_from_hf_config(config) for t in p.hf}


def test_experts_are_planned_like_qwen3_moes():
    """Every ``block_sparse_moe.experts.{E}`` tensor carries expert id E and the split of Qwen3-MoE's
    same tensor (was: replicated, no expert id)."""
    minimax, qwen = _hf(CONFIG), _hf(QWEN)
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    experts = [n for n in minimax if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * EXPERTS * 3
    for name in experts:
        layer, expert, w = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
        twin = qwen[f"model.layers.{layer}.mlp.experts.{expert}.{names[w]}.weight"]
        assert (minimax[name].expert, minimax[name].engine_split, minimax[name].shape) == (
            twin.expert, twin.engine_split, twin.shape) and twin.expert == expert
    assert minimax["model.layers.0.block_sparse_moe.gate.weight"].engine_split is EngineSplit.REPLICATED
    assert minimax["model.layers.0.block_sparse_moe.e_score_correction_bias"].expert is None
    assert qwen[ATTN + "q_norm.weight"].engine_split is EngineSplit.REPLICATED  # per head: whole on every rank
    assert (minimax[ATTN + "q_norm.weight"].engine_split, minimax[ATTN + "k_norm.weight"].engine_split) == (
        EngineSplit.ROWS, EngineSplit.KV_HEADS)


def test_expert_parallel_engines_get_their_own_experts_only():
    plan = build_plan(TrainerLayout(expert_model_parallel_size=2, data_parallel_size=2), EngineLayout(tensor_parallel_size=2,
                      expert_parallel_size=2), param_specs_from_hf_config(CONFIG))
    for t in plan.hf_tensors():
        if t.expert is not None:
            assert set(plan.engine_slices_of(t)) == {t.expert // (EXPERTS // 2)}, t.name


SGLANG_NORM = (
    "import json, sys, torch\n"
    "from sglang.srt.models.minimax_m2 import MiniMaxM2RMSNormTP\n"
    "from megarl.weight_sync.sglang_compat import presharded_tp_norm_fix\n"
    "head_dim, size, cases = json.loads(sys.argv[1])\n"
    "def norm(heads, rank):  # SGLang's __init__ without its parallel context (lines 291-315)\n"
    "    m = MiniMaxM2RMSNormTP.__new__(MiniMaxM2RMSNormTP); torch.nn.Module.__init__(m)\n"
    "    m.attn_tp_size, m.attn_tp_rank = size, rank\n"
    "    m.num_head_replicas, m.num_heads = max(1, size // heads), max(1, heads // size)\n"
    "    m.weight = torch.nn.Parameter(torch.full((m.num_heads * head_dim,), -1.0))\n"
    "    m.weight.weight_loader = m.weight_loader\n"
    "    return m\n"
    "def load(m, weight, fix):\n"
    "    try:\n"
    "        with presharded_tp_norm_fix([m] if fix else []):\n"
    "            m.weight.weight_loader(m.weight, weight)\n"
    "    except AssertionError:\n"
    "        return 'AssertionError'\n"
    "    return m.weight.long().tolist()\n"
    "out = []\n"
    "for heads, plan in cases:\n"
    "    full = torch.arange(heads * head_dim, dtype=torch.float32)\n"
    "    out.append({'rows': [load(norm(heads, r), full, False) for r in range(size)],\n"
    "                'fixed': [load(norm(heads, r), full[a:b].clone(), True) for r, (a, b) in enumerate(plan)],\n"
    "                'unfixed': [load(norm(heads, r), full[a:b].clone(), False) for r, (a, b) in enumerate(plan)]})\n"
    "print('ROWS', json.dumps(out))\n")


@pytest.mark.timeout(300)  # one SGLang import (~15-40 s)
def test_norm_slices_are_the_rows_sglang_holds_and_presharded_loads_with_the_fix():
    """q_norm over 4 engine ranks (2 of 8 heads each), k_norm over 4 ranks (2 kv heads, each held by
    2 ranks): the plan's slice of each rank = the rows SGLang's own loader keeps from the whole
    tensor; that slice sent pre-sharded is cut again by SGLang's loader (an assertion on a rank > 0,
    inside the server) and loaded as is with the fix."""
    import os
    import subprocess
    import sys

    from megarl.rollout import cpu_shims

    size = 4
    plan = build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=size), param_specs_from_hf_config(CONFIG))
    tensors = {t.name: t for t in plan.hf_tensors()}
    slices = {heads: [plan.engine_slice(tensors[ATTN + name], r) for r in range(size)]
              for name, heads in (("q_norm.weight", HEADS), ("k_norm.weight", KV_HEADS))}
    arg = json.dumps([HEAD_DIM, size, [[heads, [[s.start, s.stop] for s in sl]] for heads, sl in slices.items()]])
    env = cpu_shims.apply_to_env(dict(os.environ, OMP_NUM_THREADS="1"))
    proc = subprocess.run([sys.executable, "-c", SGLANG_NORM, arg], env=env, capture_output=True, text=True, timeout=280)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert line is not None, (proc.stdout + proc.stderr)[-3000:]
    for (heads, sl), out in zip(slices.items(), json.loads(line[5:])):
        assert out["rows"] == [list(range(s.start, s.stop)) for s in sl], heads
        assert out["fixed"] == out["rows"], heads
        assert "AssertionError" in out["unfixed"], heads  # SGLang alone cannot load the pre-sharded slices
