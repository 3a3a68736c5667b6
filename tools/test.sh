#!/usr/bin/env bash
# Install megarl (tools/install.sh) and run the test suite as CI does: unit, integration and slurm
# tests, and of the `slow` ones those also marked `ci` (every recipe's first step, one seed of each
# learning demonstration, the core end-to-end paths); not `gpu` (skips itself without CUDA), not the
# multi-seed `demo` runs. Extra arguments go to pytest (a later -m replaces the default one).
#   bash tools/test.sh                     # the suite, as CI runs it
#   bash tools/test.sh tests/unit -x       # a part of it
#   bash tools/test.sh -m slow             # the slow tests CI leaves out (and those it runs)
#   bash tools/test.sh -m demo             # the multi-seed learning demonstrations
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -m "not gpu and not demo and (not slow or ci)" --durations=25 "$@"
