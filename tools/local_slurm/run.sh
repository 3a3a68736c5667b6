#!/usr/bin/env bash
# Run one command against a fresh local Slurm, then stop it (trap), keeping the command's status.
#
#   tools/local_slurm/run.sh sbatch --wait --nodes=2 slurm/train.sbatch configs/cpu_gsm8k.yaml
#   LOCAL_SLURM_GPUS=2 tools/local_slurm/run.sh .venv/bin/python -m pytest -m slurm tests/slurm
#
# The same environment variables as start.sh apply (LOCAL_SLURM_DIR, LOCAL_SLURM_NODES, ...); the
# command sees LOCAL_SLURM_RUNNING=1 and LOCAL_SLURM_DIR (tests/slurm then reuses this cluster).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/megarl-local-slurm} LOCAL_SLURM_GPUS=${LOCAL_SLURM_GPUS:-0}
(($# > 0)) || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }
trap '"$HERE/stop.sh"' EXIT
trap 'exit 130' INT TERM
"$HERE/start.sh"
# shellcheck source=/dev/null  # written by start.sh
source "$LOCAL_SLURM_DIR/env.sh"
export LOCAL_SLURM_RUNNING=1
"$@"
