#!/usr/bin/env bash
# First checks on a bare single-GPU node: Python 3.12 with a CUDA torch, transformers, pytest and
# pytest-timeout installed, no network, no Transformer Engine / SGLang / Ray. The few wheels megarl
# needs besides (Megatron-Core, OmegaConf) come in .whl/ (made by tools/gpu_wheels.sh) and are
# installed into a private --target folder when they are not importable already.
#
# Checks, each with a one-line summary; the run stops within MEGARL_GPU_CHECK_BUDGET_S (570 s; --cpu 1500):
#   env         versions, the GPU, NCCL
#   tests       every tests/gpu test that needs neither Transformer Engine nor SGLang (the others skip),
#               among them the colocated trainer's memory cap and offload (test_colocated_memory_gpu.py,
#               test_colocated_offload_gpu.py), the FP8-engine logprob gap and the load proof on CUDA
#               (test_fp8_engine_gap_gpu.py)
#   replay      a trainer step on CUDA with NCCL (world size 1), R2 and R3 routing replay
#               (python -m megarl.testing.gpu_check replay)
#   throughput  trainer tokens/s and MFU of a ~1B-parameter Qwen3-MoE-shaped model
#
# usage: tools/gpu_check.sh [--cpu] [--only CHECK[,CHECK...]] [--python PY] [-h]
#   --cpu     the same steps on CPU (gloo, tiny model, CUDA hidden): proves the script's logic
#             without a GPU (also MEGARL_GPU_CHECK_CPU=1)
#   --only    run only these checks (env, tests, replay, throughput)
#   --python  the interpreter (default: python3 on a GPU node, .venv/bin/python with --cpu)
# Everything printed also goes to $OUT/gpu_check.log when OUT is set, with $OUT/summary.txt and
# $OUT/results.jsonl (one JSON object per Python check). Exit status: 0 if every check passed,
# 1 if any failed, 2 on a usage error.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKS_ALL="env,tests,replay,throughput"
CPU="${MEGARL_GPU_CHECK_CPU:-0}"
ONLY="$CHECKS_ALL"
PY="${PYTHON:-}"
BUDGET_S="${MEGARL_GPU_CHECK_BUDGET_S:-}"  # the whole run, seconds: each check's timeout fits in it

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die_usage() { echo "gpu_check: $1 (see --help)" >&2; exit 2; }

while (( $# )); do
    case "$1" in
        --cpu) CPU=1 ;;
        --only) (( $# >= 2 )) || die_usage "--only needs a value"; ONLY="$2"; shift ;;
        --only=*) ONLY="${1#--only=}" ;;
        --python) (( $# >= 2 )) || die_usage "--python needs a value"; PY="$2"; shift ;;
        --python=*) PY="${1#--python=}" ;;
        -h|--help) usage; exit 0 ;;
        *) die_usage "unknown argument '$1'" ;;
    esac
    shift
done
IFS=',' read -r -a SELECTED <<< "$ONLY"
(( ${#SELECTED[@]} )) || die_usage "--only names no check"
for check in "${SELECTED[@]}"; do
    [[ ",$CHECKS_ALL," == *",$check,"* ]] || die_usage "unknown check '$check' (known: $CHECKS_ALL)"
done

cd "$ROOT" || exit 1
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    TEE_PID=$!
fi
finish() {  # the exit status; the log is complete in $OUT before the script returns
    if [[ -n "${TEE_PID:-}" ]]; then exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null; fi
    exit "$1"
}
if [[ "$CPU" == 1 ]]; then
    DEVICE=cpu
    BUDGET_S="${BUDGET_S:-1500}"  # 2 busy cores import Megatron-Core in ~30-90 s per check
    export CUDA_VISIBLE_DEVICES=""  # the same steps a CPU machine would run, even on a GPU node
    [[ -n "$PY" ]] || { if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi; }
else
    DEVICE=cuda
    BUDGET_S="${BUDGET_S:-570}"  # a device run may last 600 s
    if [[ -z "$PY" ]]; then  # the device image's torch interpreter, else the first python3
        if [[ -x /opt/torch/.venv/bin/python3 ]]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
    fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
echo "gpu_check: device=$DEVICE python=$PY checks=$ONLY budget=${BUDGET_S}s ($(date -u +%FT%TZ))"

install_wheels() {  # megarl's imports that the node lacks, from .whl/ into a private folder
    "$PY" -c "import importlib.util as u; assert u.find_spec('megatron.core') and u.find_spec('omegaconf')" \
        2>/dev/null && return 0  # found without importing them (seconds on a busy machine)
    local site="${MEGARL_GPU_CHECK_SITE:-/tmp/megarl_gpu_site}"
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    shopt -u nullglob
    if (( ! ${#wheels[@]} )); then
        echo "gpu_check: megatron.core / omegaconf are not importable and .whl/ holds no wheels:" \
             "run tools/gpu_wheels.sh where pip reaches PyPI and bring .whl/ along" >&2
        return 1
    fi
    echo "gpu_check: installing ${#wheels[@]} wheels into $site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}" || return 1
    export PYTHONPATH="$PYTHONPATH:$site"
    "$PY" -W ignore -c "import megatron.core as m, omegaconf
print('gpu_check: Megatron-Core', m.__version__, 'from', m.__file__)"
}

SUMMARY=()
FAILED=0
record() {  # record NAME STATUS SECONDS TEXT
    local line
    line="$(printf 'CHECK %-10s %s %5ss  %s' "$1" "$2" "$3" "$4")"
    SUMMARY+=("$line")
    [[ "$2" == PASS ]] || FAILED=$((FAILED + 1))
    echo "$line"
}

left_s() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

run_step() {  # run_step NAME LIMIT_S CMD...: the command's output in $STEP_LOG, its status in $STEP_RC
    local name="$1" limit="$2" left
    shift 2
    left=$(left_s)
    (( limit < left )) || limit=$left
    STEP_LOG="$(mktemp)"
    STEP_START=$(date +%s)
    if (( limit < 10 )); then
        echo "gpu_check: no time left for $name (budget ${BUDGET_S}s)" | tee "$STEP_LOG"
        STEP_RC=124
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$STEP_LOG"
    STEP_RC=${PIPESTATUS[0]}
}

python_check() {  # python_check NAME LIMIT_S ARGS...: one megarl.testing.gpu_check subcommand
    local name="$1" limit="$2" text
    shift 2
    run_step "$name" "$limit" "$PY" -m megarl.testing.gpu_check "$@" --device "$DEVICE"
    [[ -z "${OUT:-}" ]] || grep '^RESULT ' "$STEP_LOG" | sed 's/^RESULT //' >> "$OUT/results.jsonl"
    text="$(grep '^SUMMARY ' "$STEP_LOG" | tail -n1 | sed 's/^SUMMARY //')"
    [[ -n "$text" ]] || text="exit $STEP_RC: $(grep -v '^\s*$' "$STEP_LOG" | tail -n1)"
    if (( STEP_RC == 0 )); then record "$name" PASS $(( $(date +%s) - STEP_START )) "$text"
    else record "$name" FAIL $(( $(date +%s) - STEP_START )) "$text"; fi
    rm -f "$STEP_LOG"
}

tests_check() {  # pytest tests/gpu; on a GPU, none may skip for want of CUDA and some must pass
    local text counts status=PASS
    run_step tests 300 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout 280
    counts="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$STEP_LOG" | tail -n1 \
              | sed 's/=//g; s/^ *//; s/ *$//')"
    text="${counts:-no pytest summary (exit $STEP_RC)}"
    if (( STEP_RC != 0 )); then
        status=FAIL
    elif [[ "$DEVICE" == cuda ]]; then
        if grep -qE '^SKIPPED.*: needs CUDA$' "$STEP_LOG"; then
            status=FAIL
            text="$text; tests skipped for want of CUDA"
        fi
        if ! grep -qE '[0-9]+ passed' <<< "$counts"; then status=FAIL; text="$text; none passed"; fi
    fi
    text="$text (skip reasons in the log)"
    record tests "$status" $(( $(date +%s) - STEP_START )) "$text"
    rm -f "$STEP_LOG"
}

[[ -z "${OUT:-}" ]] || : > "$OUT/results.jsonl"
if ! install_wheels; then
    record wheels FAIL 0 "megatron.core / omegaconf not importable with $PY"
else
    for check in "${SELECTED[@]}"; do
        case "$check" in
            env) python_check env 180 env ;;
            tests) tests_check ;;
            replay) python_check replay 240 replay ;;
            throughput) python_check throughput 300 throughput ;;
        esac
    done
fi

echo "=== gpu_check summary ($DEVICE, $(( $(date +%s) - START )) s)"
printf '%s\n' "${SUMMARY[@]}"
[[ -z "${OUT:-}" ]] || printf '%s\n' "${SUMMARY[@]}" > "$OUT/summary.txt"
if (( FAILED )); then
    echo "gpu_check: $FAILED check(s) FAILED"
    finish 1
fi
echo "gpu_check: all ${#SUMMARY[@]} checks passed"
finish 0
