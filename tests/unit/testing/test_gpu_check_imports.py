"""The GPU check carries what it imports (issue 35 item 7).

``tools/gpu_check.sh`` runs on a bare GPU node: Python's standard library, a CUDA torch,
transformers, pytest and pytest-timeout (with what pip installed for them), plus the wheels
``tools/gpu_wheels.sh`` carries (Megatron-Core, OmegaConf, installed ``--no-deps``). Every module the
check names (each import, at any depth, in ``tests/conftest.py``, ``tests/gpu/*.py``,
``megarl/testing/gpu_check.py`` and the ``megarl.testing`` helpers they use, plus the modules its
rank processes preload) is imported here in a fresh interpreter whose import system refuses any
other top-level package, as that node would. The allowed set is computed from the installed
distributions' own requirements (``importlib.metadata``), not listed by hand.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[3]
NODE_DISTRIBUTIONS = ("torch", "transformers", "pytest", "pytest-timeout")
"""What a bare GPU node has installed (README "Checking a GPU node"), with their requirements."""
CARRIED_WHEELS = ("megatron-core", "omegaconf")
"""What tools/gpu_wheels.sh carries (installed without their requirements)."""
SKIPPED_WITHOUT = ("transformer_engine", "transformer_engine_torch", "sglang", "ray")
"""Packages the check's tests skip without (``needs_te`` and the like; tools/gpu_check.sh): imported by
name in the check's files, not required; still refused when anything else imports them."""
NODE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
"""The node's interpreter for requirement markers (torch requires setuptools from Python 3.12 on)."""
CHECK_FILES = [REPO / "tests" / "conftest.py", *sorted((REPO / "tests" / "gpu").glob("*.py")),
               REPO / "megarl" / "testing" / "gpu_check.py"]


def _closure(names) -> set[str]:
    """The distributions ``names`` and, recursively, what they require on the node's Python (no extras)."""
    seen, todo = set(), [metadata.distribution(n).metadata["Name"] for n in names]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # a requirement this environment lacks (a CUDA-only one): it provides nothing here
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(NODE_MARKERS):
                todo.append(req.name)
    return seen


def allowed_top_level() -> set[str]:
    """Top-level import names a bare node provides: stdlib + the node's distributions' closure + the wheels."""
    dists = _closure(NODE_DISTRIBUTIONS) | {d.lower() for d in CARRIED_WHEELS}
    names = {top for top, owners in metadata.packages_distributions().items()
             if any(o.lower().replace("_", "-") in dists for o in owners)}
    if "setuptools" in dists:  # its vendored packages (jaraco, ...) import as top-level names
        import importlib.util

        for location in importlib.util.find_spec("setuptools").submodule_search_locations:
            names.update(p.stem for p in Path(location, "_vendor").iterdir() if not p.name.endswith("-info"))
    sysconfig_data = {m for m in sys.modules if m.startswith("_sysconfigdata")}  # the stdlib's platform table
    import sysconfig

    sysconfig_data.add(sysconfig._get_sysconfigdata_name())
    return names | set(sys.stdlib_module_names) | sysconfig_data | {"megarl", "__future__"} | {p.stem for p in CHECK_FILES if p.parent.name == "gpu"}


def _imports(path: Path) -> set[str]:
    """Every absolute module an import statement in ``path`` names, at any depth (``from a import b``:
    ``a`` and ``a.b``; the blocked interpreter tells a submodule from an attribute)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    return out


def check_modules() -> list[str]:
    """The modules the GPU check imports (module docstring), with the ``megarl.testing`` helpers'."""
    todo, files, modules = list(CHECK_FILES), set(), set()
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.add(path)
        for name in _imports(path):
            modules.add(name)
            if name.startswith("megarl.testing."):
                helper = REPO / (name.replace(".", "/") + ".py")
                if helper.exists():
                    todo.append(helper)
    from megarl.conversion.convert import RANK_PRELOAD
    from megarl.procs.local_ranks import PRELOAD

    modules.update(RANK_PRELOAD, PRELOAD)
    modules.update(p.stem for p in CHECK_FILES if p.parent.name == "gpu")  # as pytest imports them
    return sorted(m for m in modules if m.split(".")[0] not in SKIPPED_WITHOUT)


BLOCKED_IMPORTER = r'''
import importlib, importlib.util, json, sys
allowed, modules = set(json.loads(sys.argv[1])), json.loads(sys.argv[2])

class Bare:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in allowed:
            raise ModuleNotFoundError(f"{top} is not on a bare GPU node (imported as {name})", name=top)
        return None

sys.meta_path.insert(0, Bare())
real_find_spec = importlib.util.find_spec


def find_spec(name, package=None):  # a package that is not there is None, as on the node
    if not name.startswith(".") and name.split(".")[0] not in allowed:
        return None
    return real_find_spec(name, package)


importlib.util.find_spec = find_spec
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except ImportError as e:
        parent, _, attr = name.rpartition(".")
        if parent and parent in sys.modules and hasattr(sys.modules[parent], attr):
            continue  # "from a import b" where b is a name in a, not a module
        failed[name] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(failed))
'''


@pytest.mark.slow  # ~20 s: a fresh interpreter imports torch, transformers and Megatron-Core
@pytest.mark.timeout(300)
def test_every_module_the_gpu_check_imports_imports_on_a_bare_node():
    allowed = allowed_top_level()
    assert {"torch", "transformers", "pytest", "megatron", "omegaconf"} <= allowed
    assert "aiohttp" not in allowed and "ray" not in allowed and "sglang" not in allowed
    modules = check_modules()
    assert "megarl.testing.multiproc" in modules and "test_device_rule_gpu" in modules
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORTER, json.dumps(sorted(allowed)), json.dumps(modules)],
                          cwd=REPO, capture_output=True, text=True, timeout=280,
                          env={"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'gpu'}", "OMP_NUM_THREADS": "1",
                               "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(REPO),
                               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    assert json.loads(line[len("RESULT "):]) == {}
