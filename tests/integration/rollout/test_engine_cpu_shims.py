"""Each CPU shim in megarl/rollout/cpu_shims is still needed by SGLang 0.5.23, and works.

Every case imports SGLang in a fresh interpreter with the CPU switch on, the way the server
process does, with a shim directory that lacks exactly one shim: it must fail, for that shim's
reason. If such a case starts passing, SGLang or the environment no longer needs that shim: delete
it. The end-to-end proof with all shims is the server fixture every other test here uses.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from megarl.rollout import cpu_shims

pytestmark = pytest.mark.timeout(600)  # ~25 s on an idle 2-core machine; generous for shared ones

IMPORT_SCHEDULER = "import sglang.srt.managers.scheduler; print('IMPORTED')"
IMPORT_CONFIGS = "import sglang.srt.configs; print('IMPORTED')"
ALLOC_CAPTURE_BUFFER = (
    "from sglang.srt.state_capturer.base import BaseHostCache\n"
    "cache = BaseHostCache(num_tokens=4, num_layers=2, topk_size=2, name='t', device='cpu')\n"
    "assert tuple(cache.buffer.shape) == (4, 2, 2) and int(cache.buffer.abs().sum()) == 0\n"
    "print('IMPORTED')")
IMPORT_QWEN3_5 = "import sglang.srt.models.qwen3_5; print('IMPORTED')"
MINIMAX_QK_NORM = (  # what MiniMaxM2QKRMSNorm._forward_naive calls on a CPU without AMX
    "import torch\n"
    "from sglang.srt.models import minimax_m2 as m\n"
    "q, k = torch.randn(3, 8), torch.randn(3, 4)\n"
    "m.rms_apply_serial(q, k, torch.ones(8), torch.ones(4), m.rms_sumsq_serial(q, k))\n"
    "print('IMPORTED')")


def _shim_dir_without(tmp_path, missing: str | None):
    """A directory with links to every shim except ``missing``."""
    out = tmp_path / f"shims_without_{missing}"
    out.mkdir()
    for entry in cpu_shims.shim_dir().iterdir():
        stem = entry.name.removesuffix(".py")
        if stem in cpu_shims.SHIM_NAMES and stem != missing:
            (out / entry.name).symlink_to(entry)
    return out


def _run(code: str, shim_dir) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(shim_dir), SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


CASES = {
    # shim left out -> (code that the server runs, text that must appear in the failure)
    "sgl_kernel": (IMPORT_SCHEDULER, "No module named 'sgl_kernel'"),
    "torchvision": (IMPORT_CONFIGS, "No module named 'torchvision'"),
    "sitecustomize": (ALLOC_CAPTURE_BUFFER, "Torch not compiled with CUDA enabled"),
    "sglang_gdn_ops": (IMPORT_QWEN3_5, "fused_sigmoid_mul_cpu"),
    "sglang_minimax_qk_norm": (MINIMAX_QK_NORM, "is_cuda"),
}


def test_shim_inventory_matches_directory():
    names = {p.name.removesuffix(".py") for p in cpu_shims.shim_dir().iterdir()
             if not p.name.startswith(("_", "."))}
    assert names == set(cpu_shims.SHIM_NAMES)


def test_real_packages_are_absent():
    # The shims stand in for packages that cannot be installed on this CPU setup.
    for name in ("sgl_kernel", "torchvision"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: is its shim still needed?"


def test_each_shim_is_needed_and_capture_buffer_works_with_all(tmp_path):
    # Run the cases concurrently: each is a ~10 s SGLang import. (With all shims, the server
    # imports succeed in every server the other tests start, and routed-expert capture is checked
    # end to end in test_engine_generate.py.)
    procs = {missing: _run(code, _shim_dir_without(tmp_path, missing))
             for missing, (code, _) in CASES.items()}
    procs["all shims"] = _run(ALLOC_CAPTURE_BUFFER, cpu_shims.shim_dir())
    procs["qwen3_5 with all shims"] = _run(IMPORT_QWEN3_5, cpu_shims.shim_dir())
    procs["minimax q/k norm with all shims"] = _run(MINIMAX_QK_NORM, cpu_shims.shim_dir())
    try:
        outputs = {name: p.communicate(timeout=540)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for missing, (_, reason) in CASES.items():
        assert procs[missing].returncode != 0, f"SGLang worked without the {missing} shim: remove it"
        assert reason in outputs[missing], outputs[missing][-3000:]
    for name in ("all shims", "qwen3_5 with all shims", "minimax q/k norm with all shims"):
        assert procs[name].returncode == 0, outputs[name][-3000:]
        assert "IMPORTED" in outputs[name]


def test_shimmed_calls_fail_loudly(tmp_path):
    code = ("import sgl_kernel, torchvision.transforms as T\n"
            "for f in (sgl_kernel.fused_add_rmsnorm, T.Compose):\n"
            "    try:\n        f([])\n    except NotImplementedError as e:\n        print('RAISED', e)\n")
    proc = _run(code, cpu_shims.shim_dir())
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert out.count("RAISED") == 2 and "megarl" in out


def test_version_guard(monkeypatch):
    import importlib.metadata

    assert cpu_shims.check_sglang_version() == cpu_shims.SUPPORTED_SGLANG_VERSION
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    monkeypatch.delenv(cpu_shims.ALLOW_OTHER_VERSION_ENV, raising=False)
    with pytest.raises(RuntimeError, match="9.9.9"):
        cpu_shims.check_sglang_version()
    monkeypatch.setenv(cpu_shims.ALLOW_OTHER_VERSION_ENV, "1")
    assert cpu_shims.check_sglang_version() == "9.9.9"
