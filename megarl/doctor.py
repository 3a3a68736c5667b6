"""`megarl doctor`: what this machine has for megarl, and what is missing, with the fix.

Prints, without starting anything: the version of every component (Python, torch and its CUDA build,
Megatron-Core, Transformer Engine, SGLang and its kernels, FlashInfer, Ray, transformers, apex),
each CUDA device with its compute capability and memory, which FP8 recipes that device supports
(:func:`megarl.training.fp8.fp8_support_error`, the check training runs), NCCL's version and the
environment variables that steer it, and the network interfaces with their addresses. Then one line
per problem with the command that fixes it. The tested GPU stack is pinned in
``tools/constraints-gpu-cu130.txt`` (README, "On a GPU cluster").

Exit status: 0 when nothing needed for this machine's kind of run (CPU or GPU) is missing, else 1.
"""
from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

GPU_CONSTRAINTS = "tools/constraints-gpu-cu130.txt"
"""The pinned GPU stack (relative to the repository root)."""

COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("megatron-core", ("megatron-core", "megatron_core")),
    ("transformer-engine", ("transformer-engine", "transformer_engine", "transformer_engine_torch")),
    ("sglang", ("sglang",)),
    ("sglang-kernel", ("sglang-kernel", "sgl-kernel")),
    ("flashinfer", ("flashinfer-python", "flashinfer_python")),
    ("ray", ("ray",)),
    ("transformers", ("transformers",)),
    ("apex", ("apex",)),
    ("triton", ("triton",)),
    ("xgrammar", ("xgrammar",)),
    ("megarl", ("megarl",)),
)
"""(shown name, distribution names to try), in print order."""

REQUIRED_EVERYWHERE = ("torch", "megatron-core", "sglang", "ray", "transformers", "megarl")
REQUIRED_ON_GPU = ("transformer-engine", "sglang-kernel", "flashinfer")
NCCL_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME",
            "MEGARL_NODE_IFNAME", "MEGARL_NODE_IP")


@dataclass
class Report:
    """What :func:`collect` found. ``problems`` are ``(what, fix)`` pairs."""

    versions: dict[str, str | None] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)
    torch_cuda: str | None = None
    nccl: str | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)


def dist_version(names: tuple[str, ...]) -> str | None:
    """The installed version of the first of ``names`` that is installed, or None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _devices(torch: Any, te_version: str | None) -> list[dict[str, Any]]:
    from megarl.training.fp8 import FP8_RECIPES, fp8_support_error

    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        capability = (props.major, props.minor)
        fp8 = {recipe: fp8_support_error(recipe, capability=capability, torch_cuda=torch.version.cuda,
                                         te_version=te_version) for recipe in FP8_RECIPES}
        out.append({"index": i, "name": props.name, "capability": capability,
                    "memory_gib": props.total_memory / 2**30, "fp8": fp8})
    return out


def _interfaces() -> dict[str, list[str]]:
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [a.address for a in addrs if a.family in families]
            for name, addrs in sorted(psutil.net_if_addrs().items())}


def collect(torch_module: Any = None, environ: dict[str, str] | None = None,
            version_of: Callable[[tuple[str, ...]], str | None] = dist_version) -> Report:
    """Gather the report (``torch_module`` / ``environ`` / ``version_of`` are for tests)."""
    environ = dict(os.environ if environ is None else environ)
    report = Report()
    report.versions = {name: version_of(dists) for name, dists in COMPONENTS}
    for name in REQUIRED_EVERYWHERE:
        if report.versions[name] is None:
            report.problems.append((f"{name} is not installed", _install_fix(name)))
    torch = torch_module
    if torch is None and report.versions["torch"] is not None:
        import torch
    cuda = bool(torch is not None and torch.cuda.is_available())
    if torch is not None:
        report.torch_cuda = torch.version.cuda
        if cuda:
            report.devices = _devices(torch, report.versions["transformer-engine"])
            try:
                report.nccl = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # noqa: BLE001 - a torch build without NCCL
                report.nccl = None
    report.nccl_env = {k: environ[k] for k in NCCL_ENV if k in environ}
    report.interfaces = _interfaces()
    if cuda:
        for name in REQUIRED_ON_GPU:
            if report.versions[name] is None:
                report.problems.append((f"{name} is not installed (needed on GPU)", _install_fix(name)))
        if report.nccl is None:
            report.problems.append(("torch has no NCCL: weight sync and multi-GPU training need it",
                                    f"install the CUDA build of torch pinned in {GPU_CONSTRAINTS}"))
    elif report.torch_cuda is not None and torch is not None:
        report.problems.append((f"torch is a CUDA {report.torch_cuda} build but no GPU is visible "
                                "(CPU runs work; GPU runs need a driver and CUDA_VISIBLE_DEVICES)",
                                "check `nvidia-smi`; on a CPU machine use tools/install.sh (CPU torch)"))
    return report


def _install_fix(name: str) -> str:
    if name == "megarl":
        return "pip install -e . (from the repository root)"
    if name in ("transformer-engine",):
        return (f'pip install --no-build-isolation -c {GPU_CONSTRAINTS} "transformer-engine[pytorch]" '
                "(after CUDA torch)")
    if name in REQUIRED_ON_GPU or name == "sglang":
        return f'GPU: pip install -c {GPU_CONSTRAINTS} -e ".[gpu]"; CPU: bash tools/install.sh'
    return f"bash tools/install.sh (CPU) or pip install -c {GPU_CONSTRAINTS} -e \".[gpu]\" (GPU)"


def format_report(report: Report) -> str:
    """The report as the text `megarl doctor` prints."""
    lines = [f"{'python':<18} {platform.python_version()} ({sys.executable})",
             f"{'platform':<18} {platform.platform()}"]
    for name, _ in COMPONENTS:
        version = report.versions.get(name)
        extra = f" (CUDA {report.torch_cuda})" if name == "torch" and report.torch_cuda else (
            " (CPU build)" if name == "torch" and version else "")
        lines.append(f"{name:<18} {version or '-'}{extra}")
    lines.append(f"{'nccl':<18} {report.nccl or '-'}"
                 + (("  " + " ".join(f"{k}={v}" for k, v in report.nccl_env.items())) if report.nccl_env else ""))
    if not report.devices:
        lines.append(f"{'cuda devices':<18} none (CPU runs only; FP8 needs a CUDA GPU of compute capability 8.9+)")
    for d in report.devices:
        major, minor = d["capability"]
        ok = [r for r, err in d["fp8"].items() if err is None]
        lines.append(f"{'cuda:' + str(d['index']):<18} {d['name']} sm_{major}{minor} {d['memory_gib']:.0f} GiB | "
                     f"FP8 recipes: {', '.join(ok) or 'none'}")
        for recipe, err in d["fp8"].items():
            if err is not None:
                lines.append(f"{'':<18} fp8 {recipe}: {err}")
    lines.append(f"{'interfaces':<18} " + "; ".join(f"{n} {' '.join(a) or '-'}" for n, a in report.interfaces.items()))
    if report.problems:
        lines.append(f"missing ({len(report.problems)}):")
        lines.extend(f"  - {what}\n    fix: {fix}" for what, fix in report.problems)
    else:
        lines.append("nothing missing for this machine")
    return "\n".join(lines)


def main() -> int:
    """Print the report; 1 when something is missing."""
    report = collect()
    print(format_report(report))
    return 1 if report.problems else 0
