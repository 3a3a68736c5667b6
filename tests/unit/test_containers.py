"""The GPU container recipes parse (they cannot be built here: no GPU, no registry): the Dockerfile's
instructions, the Apptainer definition's header and sections, every shell body under ``bash -n``,
every file they copy exists, and both install the torch that tools/constraints-gpu-cu130.txt pins.
Plus `megarl doctor` on this machine and on a described GPU (its FP8 lines come from
megarl.training.fp8, the check training runs)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "tools" / "constraints-gpu-cu130.txt"
DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                       "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
APPTAINER_SECTIONS = {"%setup", "%files", "%environment", "%post", "%runscript", "%startscript", "%test",
                      "%labels", "%help", "%arguments"}
SHELL_SECTIONS = {"%setup", "%environment", "%post", "%runscript", "%startscript", "%test"}


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.lower()] = version
    return out


def bash_syntax_error(script: str) -> str | None:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    return proc.stderr.strip() or None if proc.returncode else None


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, arguments), continuation lines joined, comments dropped."""
    out, buf, start = [], "", 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = lineno
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        buf += stripped
        keyword, _, args = buf.partition(" ")
        out.append((start, keyword, args.strip()))
        buf = ""
    assert not buf, f"line {start}: the last instruction ends with a continuation"
    return out


def test_constraints_pin_one_version_of_each_component():
    p = pins()
    for name in ("torch", "sglang", "sglang-kernel", "flashinfer-python", "megatron-core", "transformer-engine", "ray"):
        assert re.fullmatch(r"\d+(\.\d+)+", p[name]), (name, p.get(name))
    sglang_meta = list((REPO / ".venv").glob("lib/python3*/site-packages/sglang-*.dist-info/METADATA"))
    if sglang_meta:  # SGLang's own pins (it is installed with --no-deps here)
        requires = sglang_meta[0].read_text()
        assert f"Requires-Dist: torch=={p['torch']}" in requires
        assert f"Requires-Dist: sglang-kernel=={p['sglang-kernel']}" in requires
        assert f"Requires-Dist: xgrammar=={p['xgrammar']}" in requires
    setup = (REPO / "setup.py").read_text()
    assert f'"megatron-core=={p["megatron-core"]}"' in setup and f'"ray[default]=={p["ray"]}"' in setup


def test_dockerfile_parses():
    text = (REPO / "containers" / "Dockerfile").read_text()
    instructions = dockerfile_instructions(text)
    keywords = [k for _, k, _ in instructions]
    assert set(keywords) <= DOCKER_INSTRUCTIONS, set(keywords) - DOCKER_INSTRUCTIONS
    assert next(k for k in keywords if k != "ARG") == "FROM"  # only ARGs may come before FROM
    for lineno, keyword, args in instructions:
        if keyword == "RUN":
            assert bash_syntax_error(args) is None, (lineno, bash_syntax_error(args))
        elif keyword in ("CMD", "ENTRYPOINT") and args.startswith("["):
            assert all(isinstance(x, str) for x in json.loads(args)), lineno
        elif keyword == "ENV":
            assert re.fullmatch(r"(\S+=\S+\s*)+", args), (lineno, args)
        elif keyword == "COPY":
            *sources, _dest = args.split()
            for src in sources:
                assert (REPO / src).exists(), (lineno, src)
    installs = " ".join(a for _, k, a in instructions if k == "RUN")
    assert f"torch=={pins()['torch']} --index-url https://download.pytorch.org/whl/cu130" in installs
    assert installs.count("-c tools/constraints-gpu-cu130.txt") >= 2


def test_apptainer_definition_parses():
    text = (REPO / "containers" / "megarl.def").read_text()
    header, sections, current = {}, {}, None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.startswith("%"):
            current = line.split()[0]
            assert current in APPTAINER_SECTIONS, (lineno, current)
            assert current not in sections, f"line {lineno}: {current} twice"
            sections[current] = []
        elif current is None:
            if line.strip() and not line.startswith("#"):
                key, sep, value = line.partition(":")
                assert sep and value.strip(), f"line {lineno}: header lines are 'Key: value'"
                header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    assert header["Bootstrap"] == "docker" and header["From"].startswith("nvidia/cuda:")
    docker_from = re.search(r"ARG CUDA_IMAGE=(\S+)", (REPO / "containers" / "Dockerfile").read_text()).group(1)
    assert header["From"] == docker_from  # one base image for both recipes
    for name in SHELL_SECTIONS & set(sections):
        body = "\n".join(sections[name])
        assert bash_syntax_error(body) is None, (name, bash_syntax_error(body))
    for line in sections["%files"]:
        if line.strip():
            src, _dest = line.split()
            assert (REPO / src).exists(), src
    for line in sections["%labels"]:
        if line.strip():
            assert len(line.split(None, 1)) == 2, line
    post = "\n".join(sections["%post"])
    assert f"torch=={pins()['torch']} --index-url https://download.pytorch.org/whl/cu130" in post
    assert post.count("-c tools/constraints-gpu-cu130.txt") >= 2


def test_a_broken_recipe_is_caught():
    """The checks above can fail: a shell error, an unknown instruction, a dangling continuation."""
    assert bash_syntax_error("apt-get update && (echo unterminated") is not None
    assert dockerfile_instructions("FROM x\nRUN a \\\n  b\n")[1] == (2, "RUN", "a b")
    with pytest.raises(AssertionError, match="continuation"):
        dockerfile_instructions("FROM x\nRUN a \\\n")


def test_doctor_on_this_machine():
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "megarl"), "doctor"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr
    for name in ("torch", "megatron-core", "transformer-engine", "sglang", "ray", "nccl", "cuda devices", "interfaces"):
        assert re.search(rf"^{re.escape(name)}\s", proc.stdout, re.M), name
    assert "127.0.0.1" in proc.stdout  # the loopback interface is listed


def test_doctor_on_a_described_gpu_lists_fp8_recipes_and_fixes():
    from megarl.doctor import collect, format_report

    props = SimpleNamespace(major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1, get_device_properties=lambda i: props,
                           nccl=SimpleNamespace(version=lambda: (2, 27, 3)))
    torch = SimpleNamespace(cuda=cuda, version=SimpleNamespace(cuda="13.0"))
    versions = {"transformer-engine": "2.9.0", "flashinfer": None}
    report = collect(torch_module=torch, environ={"NCCL_SOCKET_IFNAME": "ib0"},
                     version_of=lambda dists: versions.get(_name_of(dists), "1.0"))
    text = format_report(report)
    assert "NVIDIA H100 80GB HBM3 sm_90 80 GiB | FP8 recipes: delayed, tensorwise, blockwise" in text
    assert "fp8 mxfp8: fp8_recipe=mxfp8 needs Blackwell" in text
    assert "nccl               2.27.3  NCCL_SOCKET_IFNAME=ib0" in text
    assert [what for what, _ in report.problems] == ["flashinfer is not installed (needed on GPU)"]
    assert "constraints-gpu-cu130.txt" in report.problems[0][1]


def _name_of(dists: tuple[str, ...]) -> str:
    from megarl.doctor import COMPONENTS

    return next(name for name, d in COMPONENTS if d == dists)
