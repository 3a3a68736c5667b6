"""Weight-sync plan of Qwen3.5-MoE (gated attention + gated DeltaNet) against SGLang 0.5.23's own loaders.

Reference: SGLang's own loader of the DeltaNet's ``conv1d`` (``mamba_v2_sharded_weight_loader``),
run on a parameter of an engine rank's shape, says which rows of the HF tensor each engine rank holds;
the plan's row sections must name the same rows. The copy instructions (trainer side, any TP) are checked in ``test_placement.py``,
each engine rank's section blocks through every slicing path in ``test_sectioned_slices.py``, the end-to-end
sync with the load proof on a real SGLang CPU engine in ``tests/integration/weight_sync/test_load_proof.py``
(engine TP 1) and ``test_sectioned_tp2.py`` (engine TP 2).
"""
from __future__ import annotations

import pytest
import torch

from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.specs import EngineSplit

pytestmark = pytest.mark.timeout(120)

CONFIG = {"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2,
          "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 8,
          "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024,
          "torch_dtype": "float32"}
KEY_DIM, VALUE_DIM, VALUE_HEADS = 4 * 8, 8 * 4, 8


def _hf(tp: int = 1) -> dict:
    specs = param_specs_from_hf_config(CONFIG, tensor_model_parallel_size=tp)
    return {t.name: t for p in specs for t in p.hf}


def _section_rows(sections, rank: int, size: int) -> torch.Tensor:
    """Rows of an HF tensor engine rank ``rank`` holds under the plan's sections."""
    starts = [sum(sections[:i]) for i in range(len(sections))]
    return torch.cat([torch.arange(s + rank * n // size, s + (rank + 1) * n // size) for s, n in zip(starts, sections)])


def test_deltanet_and_gated_attention_tensors_get_sglangs_splits():
    hf = _hf()
    layer0, layer1 = "model.layers.0.linear_attn.", "model.layers.1.self_attn."
    expect = {layer0 + "in_proj_qkv.weight": EngineSplit.SECTION_ROWS, layer0 + "conv1d.weight": EngineSplit.SECTION_ROWS,
              layer0 + "dt_bias": EngineSplit.SECTION_ROWS, layer0 + "A_log": EngineSplit.SECTION_ROWS,
              layer0 + "in_proj_z.weight": EngineSplit.ROWS, layer0 + "in_proj_b.weight": EngineSplit.ROWS,
              layer0 + "in_proj_a.weight": EngineSplit.ROWS, layer0 + "out_proj.weight": EngineSplit.COLS,
              layer0 + "norm.weight": EngineSplit.REPLICATED,
              layer1 + "q_proj.weight": EngineSplit.ROWS, layer1 + "k_proj.weight": EngineSplit.KV_HEADS,
              layer1 + "o_proj.weight": EngineSplit.COLS, layer1 + "q_norm.weight": EngineSplit.REPLICATED}
    assert {n: hf[n].engine_split for n in expect} == expect
    assert hf[layer0 + "in_proj_qkv.weight"].sections == (KEY_DIM, KEY_DIM, VALUE_DIM)
    assert hf[layer0 + "conv1d.weight"].sections == (KEY_DIM, KEY_DIM, VALUE_DIM)
    assert hf[layer0 + "dt_bias"].sections == (VALUE_HEADS,)
    assert hf[layer1 + "q_proj.weight"].shape == (2 * 8 * 8, 32)  # [q_h; gate_h] per head


SGLANG_LOADER = (
    "import json, sys, torch\n"
    "from sglang.srt.layers.attention.mamba.mamba import mamba_v2_sharded_weight_loader\n"
    "from megarl.weight_sync.sglang_loader import unshard_sections\n"
    "sections, plan_rows, width, size = json.loads(sys.argv[1]), json.loads(sys.argv[2]), 4, 2\n"
    "full = torch.arange(sum(sections), dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, width).contiguous()\n"
    "rows, unsharded = [], []\n"
    "for rank in range(size):\n"
    "    loader = mamba_v2_sharded_weight_loader([(n, 0, False) for n in sections], size, rank)\n"
    "    param = torch.full((sum(sections) // size, 1, width), -1.0)\n"
    "    loader(param, full)\n"
    "    rows.append(param[:, 0, 0].long().tolist())\n"
    "    # the engine side of a pre-sharded load: the plan's slice put back at its rows, SGLang's loader on it\n"
    "    model = torch.nn.Module(); model.model = torch.nn.Module(); model.model.layers = torch.nn.ModuleList()\n"
    "    deltanet = torch.nn.Module(); deltanet.attn_tp_size, deltanet.attn_tp_rank = size, rank\n"
    "    deltanet.key_dim, deltanet.value_dim = sections[0], sections[2]\n"
    "    layer = torch.nn.Module(); layer.linear_attn = deltanet; model.model.layers.append(layer)\n"
    "    mine = full[torch.tensor(plan_rows[rank])]\n"
    "    param = torch.full((sum(sections) // size, 1, width), -1.0)\n"
    "    loader(param, unshard_sections(model, 'model.layers.0.linear_attn.conv1d.weight', mine))\n"
    "    unsharded.append(torch.equal(param, mine))\n"
    "print('ROWS', json.dumps([rows, unsharded]))\n")


@pytest.mark.timeout(300)  # one SGLang import (~15-40 s)
def test_sections_are_the_rows_sglangs_loaders_take():
    """SGLang's ``conv1d`` loader (``mamba_v2_sharded_weight_loader``) given the whole tensor takes, on
    each rank, exactly the rows of the plan's slice at engine TP 2 (one block per section); given
    that slice put back by megarl's engine-side loader (``unshard_sections``), it loads the slice."""
    import json
    import os
    import subprocess
    import sys

    from megarl.rollout import cpu_shims

    specs = param_specs_from_hf_config(CONFIG)
    plan = build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=2), specs)
    conv = _hf()["model.layers.0.linear_attn.conv1d.weight"]
    plan_rows = [torch.cat([torch.arange(a, b) for a, b in plan.engine_slice(conv, r).spans()]).tolist()
                 for r in range(2)]
    env = cpu_shims.apply_to_env(dict(os.environ, OMP_NUM_THREADS="1"))
    out = subprocess.run([sys.executable, "-c", SGLANG_LOADER, json.dumps(list(conv.sections)), json.dumps(plan_rows)],
                         env=env, capture_output=True, text=True, timeout=280)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert line is not None, (out.stdout + out.stderr)[-3000:]
    rows, unsharded = json.loads(line[5:])
    for rank in range(2):
        assert rows[rank] == _section_rows(conv.sections, rank, 2).tolist() == plan_rows[rank]
    assert unsharded == [True, True]


def test_engine_tp1_takes_every_tensor_whole_and_tp2_each_rank_its_section_blocks():
    specs = param_specs_from_hf_config(CONFIG, tensor_model_parallel_size=2)
    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=1, expert_model_parallel_size=2)
    one = build_plan(trainer, EngineLayout(tensor_parallel_size=1), specs)
    assert all(one.engine_slice(t, 0).axis is None for t in one.hf_tensors())
    two = build_plan(trainer, EngineLayout(tensor_parallel_size=2), specs)
    sectioned = [t for t in two.hf_tensors() if t.engine_split is EngineSplit.SECTION_ROWS]
    assert len(sectioned) == 4
    for t in sectioned:  # the two ranks' blocks partition the rows, each rank a chunk of every section
        rows = [torch.cat([torch.arange(a, b) for a, b in two.engine_slice(t, r).spans()]) for r in range(2)]
        for r in range(2):
            assert torch.equal(rows[r], _section_rows(t.sections, r, 2))
        assert torch.equal(torch.cat(rows).sort().values, torch.arange(t.shape[0]))
    total = sum(t.nbytes for t in two.hf_tensors())
    assert two.engine_rank_bytes("distributed") == [total, total]  # whole tensors: SGLang's loaders shard them
    assert two.engine_rank_bytes("p2p") == two.engine_shard_bytes() and max(two.engine_shard_bytes()) < total
