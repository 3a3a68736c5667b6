"""What each rank of a CPU SGLang engine holds of an MLP projection (engine TP > 1), against SGLang 0.5.23.

The reference is SGLang's own code, run in a subprocess with the server's CPU environment: its CPU model
runner pads the config's MLP sizes before building the model (``configs/update_config.py``:
``update_intermediate_size`` with ``tp_size * get_moe_padding_size(None)``), and each rank loads its
padded chunk from disk through ``narrow_padded_param_and_loaded_weight`` (``model_loader/weight_utils.py``),
the function its CPU linears and FusedMoE call. Loading ``arange`` tensors that way tells which real
rows / columns each rank holds; megarl's ``engine_slices`` must name exactly those (a rank holding only
padding: none). Before the fix megarl split the unpadded size evenly: the tiny DeepSeek-V3's shared
expert ``down_proj`` [64, 32] went as [64, 16] per rank at engine TP 2, where SGLang's rank 0 holds
[64, 32] (``moe_intermediate_size`` 32 padded to 64) and its ``RowParallelLinear`` refused the slice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megarl.models.tiny import TinyModelSpec, _hf_config
from megarl.weight_sync.engine_slices import PlanError, engine_slices
from megarl.weight_sync.layout import EngineLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config

SCRIPT = textwrap.dedent("""
    import json, sys, types, torch
    from sglang.srt.configs.update_config import get_moe_padding_size, update_intermediate_size
    from sglang.srt.model_loader.weight_utils import narrow_padded_param_and_loaded_weight

    cases = json.loads(sys.stdin.read())
    out = []
    for case in cases:
        tp, sizes = case["tp"], dict(case["sizes"])
        model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(**sizes))
        # model_runner.py:1301 -> adjust_config_with_unaligned_cpu_tp (update_config.py:290-303), no quant config
        for attr in sizes:
            update_intermediate_size(model_config, attr, tp * get_moe_padding_size(None))
        padded = vars(model_config.hf_config)
        held = []
        for width, attr, times, shards in case["tensors"]:  # times: n_shared_experts (deepseek_v2.py:870)
            shard = padded[attr] * times // shards
            full = torch.arange(width, dtype=torch.float32) + 1.0
            ranks = []
            for rank in range(shards):
                param = torch.zeros(shard)  # a rank's padded chunk, loaded as from disk (linear.py:1678)
                p, w = narrow_padded_param_and_loaded_weight(param, full, 0, rank * shard, 0, shard)
                p.copy_(w)
                ranks.append([int(v) - 1 for v in param.tolist() if v > 0])
            held.append(ranks)
        out.append(held)
    print(json.dumps(out))
""")

FAMILIES = ("qwen3_moe", "qwen3", "deepseek_v3", "glm4_moe", "kimi_k25")


def _sglang_holds(cases: list[dict]) -> list:
    from megarl.rollout import cpu_shims

    env = cpu_shims.apply_to_env(dict(os.environ))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps(cases), env=env, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _text(config):
    return getattr(config, "text_config", None) or config  # Kimi-K2.5 nests its language model's


def _num_experts(config) -> int:
    text = _text(config)
    return getattr(text, "n_routed_experts", None) or getattr(text, "num_experts", None) or 1


def _mlp_tensors(config, tp: int, ep: int):
    """``[(spec, axis, config attribute, sections, ranks splitting it)]`` of every MLP projection of ``config``."""
    shared = getattr(_text(config), "n_shared_experts", None) or 1
    out = []
    for param in param_specs_from_hf_config(config, dtype="float32"):
        for t in param.hf:
            module = t.name.rsplit(".", 2)[-2]
            if module not in ("gate_proj", "up_proj", "down_proj"):
                continue
            attr = "moe_intermediate_size" if ".experts." in t.name else "intermediate_size"
            axis = 1 if module == "down_proj" else 0
            times = shared if ".shared_experts." in t.name else 1
            ranks = tp // ep if t.expert is not None else tp
            out.append((t, axis, attr, times, ranks))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_engine_ranks_hold_what_sglang_loads_from_disk():
    """Every MLP projection of every tiny family with a TP > 1 recipe, at CPU engine TP 1, 2, 4 and TP 4 EP 2
    (one SGLang import for all: ~1 min on the loaded 2-core machine, hence ``slow``)."""
    configs = {f: _hf_config(TinyModelSpec(family=f), 2048, 1, 0)[0] for f in FAMILIES}
    layouts = [(1, 1), (2, 1), (4, 1), (4, 2)]
    tensors = {(f, tp, ep): _mlp_tensors(c, tp, ep) for f, c in configs.items() for tp, ep in layouts}
    cases = []
    for (f, tp, _ep), listed in tensors.items():
        text = _text(configs[f])
        sizes = {a: getattr(text, a) for a in ("moe_intermediate_size", "intermediate_size") if hasattr(text, a)}
        cases.append({"tp": tp, "sizes": sizes,
                      "tensors": [[t.shape[axis], attr, times, ranks] for t, axis, attr, times, ranks in listed]})
    checked = 0
    for ((family, tp, ep), listed), held in zip(tensors.items(), _sglang_holds(cases)):
        layout = EngineLayout(tensor_parallel_size=tp, expert_parallel_size=ep, device="cpu")
        num_experts = _num_experts(configs[family])
        for (t, axis, _, _, _), sglang in zip(listed, held):
            slices = engine_slices(t, layout, num_experts)
            # a routed expert lives on the moe_tp ranks of its EP rank (layout.py), experts contiguous per EP rank
            first = t.expert // (num_experts // ep) * (tp // ep) if t.expert is not None else 0
            assert set(slices) <= set(range(first, first + len(sglang))), (family, t.name, slices)
            for k, indices in enumerate(sglang):
                sl = slices.get(first + k)
                mine = [] if sl is None else (list(range(t.shape[axis])) if sl.axis is None
                                              else list(range(sl.start, sl.stop)))
                assert mine == indices, (family, t.name, tp, ep, k, sl)
                checked += 1
    assert checked > 1000


def test_tiny_deepseek_shared_expert_at_cpu_tp2_goes_whole_to_rank_0():
    """The failure of DeepSeek-V3's twin at engine TP 2, as slices: rank 0 holds the shared expert's
    32 columns (its padded chunk, SGLang's ``[64, 32]`` parameter), rank 1 only padding."""
    config = _hf_config(TinyModelSpec(family="deepseek_v3"), 2048, 1, 0)[0]
    specs = {t.name: t for p in param_specs_from_hf_config(config, dtype="float32") for t in p.hf}
    down = specs["model.layers.1.mlp.shared_experts.down_proj.weight"]
    cpu, cuda = EngineLayout(tensor_parallel_size=2, device="cpu"), EngineLayout(tensor_parallel_size=2)
    assert down.shape == (64, 32)
    assert {r: s.shape(down.shape) for r, s in engine_slices(down, cpu, 8).items()} == {0: (64, 32)}
    assert {r: s.shape(down.shape) for r, s in engine_slices(down, cuda, 8).items()} == {0: (64, 16), 1: (64, 16)}
    dense = specs["model.layers.0.mlp.down_proj.weight"]  # intermediate_size 128: no padding at TP 2
    assert {r: s.shape(dense.shape) for r, s in engine_slices(dense, cpu, 8).items()} == {0: (64, 64), 1: (64, 64)}


def test_a_partly_padded_chunk_is_refused_naming_the_tensor():
    """``moe_intermediate_size`` 48 at CPU TP 2 (padded to 64): rank 1 would hold 16 real columns and 16
    of zeros. SGLang's RowParallelLinear asserts the padded shape for a pre-sharded weight and megarl's
    receiver takes only slices that divide the checkpoint's shape, so every such MLP tensor is refused
    by name (the sync then goes whole: ``distributed``); the dense MLP (128: no padding) keeps its split.
    A dense row-parallel tensor is refused even when the part-padded chunk is all of it (TP 1)."""
    config = _hf_config(TinyModelSpec(family="deepseek_v3", moe_intermediate_size=48), 2048, 1, 0)[0]
    specs = {t.name: t for p in param_specs_from_hf_config(config, dtype="float32") for t in p.hf}
    cpu = EngineLayout(tensor_parallel_size=2, device="cpu")
    for name in ("shared_experts.down_proj", "shared_experts.gate_proj", "experts.3.down_proj", "experts.3.up_proj"):
        why = "RowParallelLinear" if name == "shared_experts.down_proj" else "only when it is the whole tensor"
        with pytest.raises(PlanError, match=rf"{name}.*pads its 48 .* to 64.*{why}"):
            engine_slices(specs[f"model.layers.1.mlp.{name}.weight"], cpu, 8)
    assert len(engine_slices(specs["model.layers.0.mlp.down_proj.weight"], cpu, 8)) == 2
    assert len(engine_slices(specs["model.layers.1.mlp.shared_experts.down_proj.weight"], EngineLayout(
        tensor_parallel_size=2), 8)) == 2  # a GPU engine does not pad
    one = EngineLayout(tensor_parallel_size=1, device="cpu")
    with pytest.raises(PlanError, match="shared_experts.down_proj.*RowParallelLinear"):
        engine_slices(specs["model.layers.1.mlp.shared_experts.down_proj.weight"], one, 8)
    assert engine_slices(specs["model.layers.1.mlp.shared_experts.gate_proj.weight"], one, 8)[0].axis is None
