#!/usr/bin/env bash
# One task of a multi-node torch.distributed step (slurm/convert.sbatch): translate Slurm's task
# variables into torch.distributed's env:// ones, then exec the command.
#   srun ... bash slurm/lib/dist_rank.sh CMD [ARGS...]     (MASTER_ADDR, MASTER_PORT exported)
# Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, and GLOO_SOCKET_IFNAME (the
# interface holding MEGARL_NODE_IP, else MEGARL_NODE_IFNAME, when set) unless already set.
set -euo pipefail
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID NODE_RANK=$SLURM_NODEID
LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-1}
export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE%%(*}  # "8(x4)" -> 8
if [[ -z ${GLOO_SOCKET_IFNAME:-} && -n ${MEGARL_NODE_IP:-} ]]; then
  GLOO_SOCKET_IFNAME=$(ip -o -4 addr show | awk -v ip="$MEGARL_NODE_IP" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')
  export GLOO_SOCKET_IFNAME
elif [[ -z ${GLOO_SOCKET_IFNAME:-} && -n ${MEGARL_NODE_IFNAME:-} ]]; then
  export GLOO_SOCKET_IFNAME=$MEGARL_NODE_IFNAME
fi
exec "$@"
