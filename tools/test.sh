#!/usr/bin/env bash
# Install megarl (tools/install.sh) and run the test suite as CI does: unit, integration and slurm
# tests, and of the `slow` ones those also marked `ci` (every recipe's first step, one seed of each
# learning demonstration, the core end-to-end paths); not `gpu` (skips itself without CUDA), not the
# multi-seed `demo` runs.
#
# Without arguments (CI) the suite runs in two phases on the 2-core CI machine, and ruff and mypy
# (bash tools/lint.sh) beside the first; a lint finding fails the run, after the tests:
#   1. tests/unit (then the light integration tests in BESIDE_SLURM: no server, no trainer rank) and
#      tests/slurm side by side: the unit tests keep one core busy, the Slurm tests mostly wait (job
#      scheduling, nodes joining, the bounded-failure timers), so the second core is otherwise idle;
#      each writes its own report, printed in full when both have ended;
#   2. the rest of tests/integration, in two streams side by side: the whole-run tests in BESIDE_REST
#      (the one-seed learning demonstrations and the async run: ~22 min alone, mostly one engine
#      decoding or two trainer ranks) and everything else (servers, trainer ranks, recipes: ~31 min
#      alone, with start-ups and waits). Both streams take their ports from megarl's allocator, and Ray
#      instances pick their own ports, so they never collide; each writes its own report.
# The run fails when either phase fails. With arguments, one pytest gets them (a later -m replaces
# the default one):
#   bash tools/test.sh                     # the suite, as CI runs it
#   bash tools/test.sh tests/unit -x       # a part of it
#   bash tools/test.sh -m slow             # the slow tests CI leaves out (and those it runs)
#   bash tools/test.sh -m demo             # the multi-seed learning demonstrations
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
PYTEST=(.venv/bin/python -m pytest -m "not gpu and not demo and (not slow or ci)" --durations=25)
if [[ $# -gt 0 ]]; then
  exec "${PYTEST[@]}" "$@"
fi

BESIDE_SLURM=(tests/integration/launch/test_launch_broken_config.py tests/integration/test_repository_clone.py
              tests/integration/launch/test_launch_gpu_placement.py tests/integration/launch/test_local_ray_loopback.py)
# pytest exit 5 = nothing collected in that part: not a failure of the part
ok() { [[ $1 -eq 0 || $1 -eq 5 ]]; }
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
start=$SECONDS
"${PYTEST[@]}" tests/slurm > "$LOGS/slurm.log" 2>&1 &
slurm_pid=$!
bash tools/lint.sh > "$LOGS/lint.log" 2>&1 &  # ~1 min of one core, while the Slurm tests wait
lint_pid=$!
set +e
"${PYTEST[@]}" tests/unit "${BESIDE_SLURM[@]}"
unit_rc=$?
wait "$slurm_pid"
slurm_rc=$?
wait "$lint_pid"
lint_rc=$?
set -e
echo "================ tools/lint.sh: ruff, mypy (ran beside tests/unit) ================"
cat "$LOGS/lint.log"
echo "test.sh: lint exit $lint_rc"
echo "================ tests/slurm (ran beside tests/unit) ================"
cat "$LOGS/slurm.log"
echo "test.sh: phase 1 (unit beside slurm) took $((SECONDS - start)) s; unit exit $unit_rc, slurm exit $slurm_rc"
BESIDE_REST=(tests/integration/launch/test_launch_search_demo.py tests/integration/launch/test_launch_learning_demo.py
             tests/integration/launch/test_launch_async_e2e.py)
start=$SECONDS
"${PYTEST[@]}" "${BESIDE_REST[@]}" > "$LOGS/runs.log" 2>&1 &
runs_pid=$!
set +e
"${PYTEST[@]}" tests/integration "${BESIDE_SLURM[@]/#/--ignore=}" "${BESIDE_REST[@]/#/--ignore=}"
integration_rc=$?
echo "test.sh: phase 2, the rest of tests/integration, took $((SECONDS - start)) s; exit $integration_rc"
wait "$runs_pid"
runs_rc=$?
set -e
echo "================ whole runs (ran beside the rest of tests/integration) ================"
cat "$LOGS/runs.log"
echo "test.sh: phase 2 (integration, two streams) took $((SECONDS - start)) s; whole runs exit $runs_rc"
if ok $unit_rc && ok $slurm_rc && ok $integration_rc && ok $runs_rc && [[ $lint_rc -eq 0 ]]; then
  exit 0
fi
for rc in $unit_rc $slurm_rc $integration_rc $runs_rc $lint_rc; do
  if ! ok "$rc"; then exit "$rc"; fi
done
