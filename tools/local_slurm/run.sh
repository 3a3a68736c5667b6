#!/usr/bin/env bash
# Run one command against a fresh local Slurm, then stop it (trap), keeping the command's status.
#
#   tools/local_slurm/run.sh sbatch --wait --nodes=2 slurm/train.sbatch configs/gsm8k_tool_cpu.yaml
#   tools/local_slurm/run.sh .venv/bin/python -m pytest -m slurm tests/slurm
#
# The same environment variables as start.sh apply (LOCAL_SLURM_DIR, LOCAL_SLURM_NODES, ...).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/megarl-local-slurm}
(($# > 0)) || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }
trap '"$HERE/stop.sh"' EXIT
trap 'exit 130' INT TERM
"$HERE/start.sh"
# shellcheck source=/dev/null  # written by start.sh
source "$LOCAL_SLURM_DIR/env.sh"
export LOCAL_SLURM_RUNNING=1
"$@"
