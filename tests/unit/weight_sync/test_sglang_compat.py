"""The CPU pre-sharded loading quirk of SGLang 0.5.23 still exists, and megarl's fix undoes it.

Runs in a subprocess with the server's CPU environment (megarl's CPU shims on ``PYTHONPATH``,
``SGLANG_USE_CPU_ENGINE=1``), calling SGLang's real ``narrow_padded_param_and_loaded_weight`` the
way its column-parallel linears do for a pre-sharded weight on TP rank 1.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, torch
    from sglang.srt.model_loader import weight_utils
    from megarl.weight_sync.sglang_compat import cpu_presharded_qkv_fix, cpu_quirk_applies

    def load_rank1(fn):
        param = torch.zeros(2, 3)                 # rank 1's parameter: 2 of 4 rows
        shard = torch.ones(2, 3)                  # rank 1's pre-sharded weight
        # linear.py (CPU branch): weight_start = tp_rank * shard_size, narrow_weight = not presharded
        p, w = fn(param, shard, 0, 2, 0, 2, False)
        if p.shape == w.shape:                    # linear.py asserts this before copying
            p.copy_(w)
        return [list(p.shape), param.sum().item()]

    out = {"applies": cpu_quirk_applies(), "without_fix": load_rank1(weight_utils.narrow_padded_param_and_loaded_weight)}
    with cpu_presharded_qkv_fix():
        out["with_fix"] = load_rank1(weight_utils.narrow_padded_param_and_loaded_weight)
    out["restored"] = weight_utils.narrow_padded_param_and_loaded_weight.__module__ == weight_utils.__name__
    print(json.dumps(out))
""")


@pytest.mark.timeout(180)
def test_cpu_presharded_column_quirk_is_still_there_and_fixed():
    from megarl.rollout import cpu_shims

    env = cpu_shims.apply_to_env(dict(os.environ))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["applies"]
    # the quirk: rank 1's parameter is narrowed to 0 rows, so linear.py's shape assertion fails inside
    # the server (an exception in a weight loader takes the engine down)
    assert out["without_fix"] == [[0, 3], 0.0]
    assert out["with_fix"] == [[2, 3], 6.0]      # the fix: both rows of rank 1 are loaded
    assert out["restored"]
