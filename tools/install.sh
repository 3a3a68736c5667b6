#!/usr/bin/env bash
# Install megarl into a virtual environment on a fresh CPU machine (Python 3.11).
#
#   tools/install.sh [VENV_DIR]        (default: .venv in the repository root)
#
# What it installs, and why each step is done this way (see docs/architecture.md, "Running on CPU"):
#   1. torch 2.13.0, CPU build. Every later pip call is constrained to it so nothing pulls CUDA torch.
#   2. SGLang 0.5.23 with --no-deps: its metadata pins CUDA-only packages (torch 2.14.1, flashinfer,
#      sglang-kernel). Its CPU runtime dependencies are listed in tools/requirements-sglang-cpu.txt.
#   3. triton with --no-deps: SGLang imports it at import time; it is never used on the CPU path.
#      torchvision is deliberately NOT installed: the PyPI wheel is CUDA-linked and breaks
#      `import transformers.image_utils` on CPU torch. The SGLang server imports
#      torchvision.transforms at start even for text models; megarl/rollout/cpu_shims gives the CPU
#      server process (only) an import-only torchvision instead.
#   4. megarl itself (editable) with its core dependencies and the test tools.
# Idempotent: re-running skips what is already installed. Never downloads model weights.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
CONSTRAINTS=$ROOT/tools/constraints-cpu.txt

if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [[ -f $VENV/.megarl-installed ]] && cmp -s "$VENV/.megarl-installed" <(cat "$ROOT/setup.py" "$ROOT/tools/requirements-sglang-cpu.txt" "$0"); then
  echo "megarl: $VENV is up to date"
  exit 0
fi

"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" -c "$CONSTRAINTS" -r "$ROOT/tools/requirements-sglang-cpu.txt"
"${PIP[@]}" --no-deps triton==3.9.0
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[test]"
"$VENV/bin/python" -c "import torch, megatron.core, sglang, ray; assert torch.__version__.endswith('+cpu'), torch.__version__; print('megarl: installed torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'sglang', sglang.__version__, 'ray', ray.__version__)"
cat "$ROOT/setup.py" "$ROOT/tools/requirements-sglang-cpu.txt" "$0" > "$VENV/.megarl-installed"
