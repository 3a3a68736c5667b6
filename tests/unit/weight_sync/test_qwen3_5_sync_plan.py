"""Weight-sync plan of Qwen3.5-MoE (gated attention + gated DeltaNet) against SGLang 0.5.23's own loaders.

Reference: SGLang's own loader of the DeltaNet's ``conv1d`` (``mamba_v2_sharded_weight_loader``),
run on a parameter of an engine rank's shape, says which rows of the HF tensor each engine rank holds;
the plan's row sections must name the same rows. The copy instructions (trainer side, any TP) are checked in ``test_placement.py``,
the end-to-end sync with the load proof on a real SGLang CPU engine in
``tests/integration/weight_sync/test_load_proof.py``.
"""
from __future__ import annotations

import pytest
import torch

from megarl.weight_sync.engine_slices import PlanError
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
    "sections, width, size = json.loads(sys.argv[1]), 4, 2\n"
    "full = torch.arange(sum(sections), dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, width).contiguous()\n"
    "rows = []\n"
    "for rank in range(size):\n"
    "    param = torch.full((sum(sections) // size, 1, width), -1.0)\n"
    "    mamba_v2_sharded_weight_loader([(n, 0, False) for n in sections], size, rank)(param, full)\n"
    "    rows.append(param[:, 0, 0].long().tolist())\n"
    "print('ROWS', json.dumps(rows))\n")


@pytest.mark.timeout(300)  # one SGLang import (~15-40 s)
def test_sections_are_the_rows_sglangs_loaders_take():
    # SGLang's conv1d loader, in a process with megarl's CPU shims (SGLang imports torchvision).
    import json
    import os
    import subprocess
    import sys

    from megarl.rollout import cpu_shims

    conv = _hf()["model.layers.0.linear_attn.conv1d.weight"]
    env = cpu_shims.apply_to_env(dict(os.environ, OMP_NUM_THREADS="1"))
    out = subprocess.run([sys.executable, "-c", SGLANG_LOADER, json.dumps(list(conv.sections))], env=env,
                         capture_output=True, text=True, timeout=280)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert line is not None, (out.stdout + out.stderr)[-3000:]
    for rank, rows in enumerate(json.loads(line[5:])):
        assert rows == _section_rows(conv.sections, rank, 2).tolist()


def test_engine_tp1_takes_every_tensor_whole_and_tp2_presharded_is_a_named_refusal():
    specs = param_specs_from_hf_config(CONFIG, tensor_model_parallel_size=2)
    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=1, expert_model_parallel_size=2)
    one = build_plan(trainer, EngineLayout(tensor_parallel_size=1), specs)
    assert all(one.engine_slice(t, 0).axis is None for t in one.hf_tensors())
    two = build_plan(trainer, EngineLayout(tensor_parallel_size=2), specs)
    with pytest.raises(PlanError, match=r"linear_attn\.(in_proj_qkv|conv1d|dt_bias|A_log).*only whole"):
        two.engine_shard_bytes()
    total = sum(t.nbytes for t in two.hf_tensors())
    assert two.engine_rank_bytes("distributed") == [total, total]  # whole tensors: SGLang's loaders shard them
