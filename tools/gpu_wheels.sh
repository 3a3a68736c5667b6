#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh needs on a bare GPU node (Python 3.12, x86-64, a CUDA torch
# already installed, no network) into .whl/ of this repository, and check they fit its 64 MiB limit.
#
# Exactly what megarl's trainer imports that such a node lacks: Megatron-Core and OmegaConf, at the
# versions setup.py pins (OmegaConf 2.4 vendors its antlr4 runtime). The node has Python's standard
# library, torch, transformers, pytest and pytest-timeout with what pip installed for them (numpy,
# packaging, safetensors, tokenizers, pyyaml, ...), nothing else: no aiohttp, psutil or einops, no
# Transformer Engine, SGLang or Ray. tests/unit/testing/test_gpu_check_imports.py imports every module the
# check imports with only those and these two wheels importable.
#
# usage: tools/gpu_wheels.sh            (run where pip can reach PyPI; PYTHON=... picks the pip)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LIMIT_BYTES=$((64 * 1024 * 1024))
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

pin() {  # the exact requirement setup.py pins for a distribution
    local spec
    spec="$(grep -oE "\"$1==[0-9][0-9.]*\"" setup.py | tr -d '"' | head -n1)"
    [[ -n "$spec" ]] || { echo "gpu_wheels: setup.py pins no $1==VERSION" >&2; exit 1; }
    echo "$spec"
}
REQS=("$(pin megatron-core)" "$(pin omegaconf)")

# .whl/ never enters git: .gitignore lists /.whl/, and so does this clone's info/exclude.
EXCLUDE="$(git rev-parse --git-path info/exclude 2>/dev/null || true)"
if [[ -n "$EXCLUDE" ]] && ! grep -qxF "/.whl/" "$EXCLUDE" 2>/dev/null; then
    mkdir -p "$(dirname "$EXCLUDE")" && echo "/.whl/" >> "$EXCLUDE"
fi

rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${REQS[@]}"

shopt -s nullglob
wheels=(.whl/*.whl)
if (( ${#wheels[@]} != ${#REQS[@]} )); then
    echo "gpu_wheels: expected ${#REQS[@]} wheels (${REQS[*]}), got ${#wheels[@]}: ${wheels[*]}" >&2
    exit 1
fi
total=0
for w in "${wheels[@]}"; do
    size=$(stat -c %s "$w")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "$(basename "$w")"
done
printf '%10d  total (%.2f MiB; limit 64 MiB)\n' "$total" "$(awk "BEGIN {print $total / 1048576}")"
if (( total >= LIMIT_BYTES )); then
    echo "gpu_wheels: the wheels are ${total} bytes, over the 64 MiB a device run carries" >&2
    exit 1
fi
