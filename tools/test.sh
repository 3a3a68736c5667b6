#!/usr/bin/env bash
# Install megarl (tools/install.sh) and run the test suite: unit, integration, slurm and slow tests
# (everything but `gpu`, which skips itself without CUDA, and the multi-seed `demo` runs). Extra
# arguments go to pytest (a later -m replaces the default one).
#   bash tools/test.sh                     # the whole suite, as CI runs it
#   bash tools/test.sh tests/unit -x       # a part of it
#   bash tools/test.sh -m demo             # the multi-seed learning demonstrations
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -m "not gpu and not demo" --durations=25 "$@"
