#!/usr/bin/env bash
# Runs on one node of a megarl Slurm job (started by slurm/lib/megarl_job.sh through srun).
#
#   ray_node.sh probe
#       print "SLURMD_NODENAME IP CPUS GPUS" for this node: the address Ray and the collectives use
#       (MEGARL_NODE_IP, else the IPv4 address of MEGARL_NODE_IFNAME, else the first address of
#       `hostname --ip-address`) and the job's CPUs and GPUs on it.
#   ray_node.sh head   INDEX IP NUM_CPUS NUM_GPUS RESOURCES_JSON WORKER_PORT_LO WORKER_PORT_HI
#   ray_node.sh worker INDEX IP NUM_CPUS NUM_GPUS RESOURCES_JSON WORKER_PORT_LO WORKER_PORT_HI
#       exec `ray start --block` (head: GCS on MEGARL_RAY_PORT; worker: joins MEGARL_RAY_HEAD).
#       NUM_GPUS -1 lets Ray detect the GPUs. The step lives exactly as long as this node's Ray:
#       if the raylet dies, `ray start --block` exits and so does the srun step, which is how the
#       batch script notices a lost node. Stopped by signalling the srun step (never `ray stop`).
#
# Environment (exported by the batch script): MEGARL_RAY_PORT, MEGARL_RAY_HEAD, MEGARL_RAY_TMPDIR,
# MEGARL_RAY_CLIENT_PORT, MEGARL_RAY_START_ARGS, MEGARL_RAY_DASHBOARD,
# GLOO_SOCKET_IFNAME (default here: the interface that holds IP).
set -euo pipefail

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

node_ip() {
  if [[ -n ${MEGARL_NODE_IP:-} ]]; then
    echo "$MEGARL_NODE_IP"
  elif [[ -n ${MEGARL_NODE_IFNAME:-} ]]; then
    ip -o -4 addr show dev "$MEGARL_NODE_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}'
  else
    hostname --ip-address | awk '{print $1}'
  fi
}

ifname_of() {  # the interface holding IPv4 address $1
  ip -o -4 addr show | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'
}

cmd=${1:?usage: ray_node.sh probe|head|worker ...}
if [[ $cmd == probe ]]; then
  ip_addr=$(node_ip)
  [[ -n $ip_addr ]] || { echo "megarl: no IPv4 address found on $(hostname) (set MEGARL_NODE_IP or MEGARL_NODE_IFNAME)" >&2; exit 1; }
  echo "${SLURMD_NODENAME:-$(hostname)} $ip_addr ${SLURM_CPUS_ON_NODE:-0} ${SLURM_GPUS_ON_NODE:-0}"
  exit 0
fi

# megarl's single-host switch (megarl.cluster.placement.LOCAL_RAY_LOOPBACK_ENV) makes a joining node
# refuse ("Multi-node Ray clusters are not supported"): never let an inherited one reach a cluster.
unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
index=$2 ip_addr=$3 num_cpus=$4 num_gpus=$5 resources=$6 port_lo=$7 port_hi=$8
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$(ifname_of "$ip_addr")}
tmpdir=$MEGARL_RAY_TMPDIR/n$index
mkdir -p "$tmpdir"
args=(--node-ip-address="$ip_addr" --temp-dir="$tmpdir" --resources="$resources"
  --min-worker-port="$port_lo" --max-worker-port="$port_hi"
  --dashboard-agent-listen-port="$(free_port)" --disable-usage-stats --block)
((num_cpus > 0)) && args+=(--num-cpus="$num_cpus")
((num_gpus >= 0)) && args+=(--num-gpus="$num_gpus")
if [[ $cmd == head ]]; then
  args+=(--head --port="$MEGARL_RAY_PORT" --ray-client-server-port="${MEGARL_RAY_CLIENT_PORT:-$(free_port)}")
  if [[ ${MEGARL_RAY_DASHBOARD:-0} == 1 ]]; then
    args+=(--include-dashboard=true --dashboard-host=0.0.0.0 --dashboard-port="${MEGARL_RAY_DASHBOARD_PORT:-8265}")
  else
    args+=(--include-dashboard=false)
  fi
else
  args+=(--address="$MEGARL_RAY_HEAD")
fi
read -ra extra <<<"${MEGARL_RAY_START_ARGS:-}"
echo "megarl: $(hostname) node $index: GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME ray logs in $(hostname):$tmpdir/session_latest/logs"
exec ray start "${args[@]}" "${extra[@]}"
