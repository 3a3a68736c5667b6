#!/usr/bin/env bash
# Start a throw-away, real Slurm cluster on this one machine, for CI and laptops (run as root).
#
#   tools/local_slurm/start.sh            # then: source "$LOCAL_SLURM_DIR/env.sh"; sbatch ...
#   tools/local_slurm/stop.sh             # stops exactly what this script started
#   tools/local_slurm/run.sh CMD [ARGS]   # start, run CMD with the wrappers on PATH, stop (trap)
#
# What runs, all recorded by PID under $LOCAL_SLURM_DIR/run (nothing is ever stopped by name):
#   - a private munged (own key, socket, pid and log files under $LOCAL_SLURM_DIR/munge), so a
#     munged that the machine already runs is neither used nor disturbed;
#   - slurmctld and $LOCAL_SLURM_NODES slurmd daemons (Debian's Slurm is built with
#     multiple-slurmd support), each started with `nsenter --net` in a network namespace. Slurm
#     22.05 binds 0.0.0.0 and has no option to change that; the namespaces keep the cluster off
#     every real interface. (`ip netns exec` is not used: it remounts /sys and slurmd then fails
#     on cgroups.) Two layouts:
#       multi-host (default): every node is an emulated host (megarl/testing/netns.py): its own
#         namespace $NETNS-nodeK with its own loopback and address on a private bridge
#         ($LOCAL_SLURM_SUBNET: node K gets the K-th address, interface eth0), and slurmctld on
#         one more host, $NETNS-ctl. Jobs, Ray and engines on different nodes reach each other
#         only through those addresses. The bridge lives in its own namespace: nothing is added
#         to the machine's network, and there is no route out.
#       single namespace (LOCAL_SLURM_MULTIHOST=0): node1..nodeN all on 127.0.0.1 (one port
#         each) in one namespace $NETNS that has only loopback.
#     Each slurmd also gets its own /dev/shm (LOCAL_SLURM_PRIVATE_SHM): it starts in a new mount
#     namespace (`unshare --mount`, private propagation) with a fresh tmpfs on /dev/shm, which its
#     job steps inherit. Network namespaces alone share the machine's /dev/shm, and SGLang takes a
#     rank's opening another's shared-memory segment as proof that both sit on one node
#     (parallel_state.in_the_same_node_as): an engine spanning two emulated nodes then waited on
#     its own loopback. The tmpfs goes with the last process of that mount namespace (slurmd and
#     whatever its jobs left; stop.sh kills both by PID): nothing to unmount.
#   - PATH wrappers $LOCAL_SLURM_DIR/bin/{sbatch,srun,salloc,squeue,scancel,sinfo,scontrol,sacct}
#     that enter the controller's namespace when called from outside the cluster (and run the
#     command as it is inside a node), so scripts run unchanged: `source $LOCAL_SLURM_DIR/env.sh`
#     (multi-host: it also sets MEGARL_NODE_IFNAME=eth0, the interface of each node's address).
# If Slurm or munge is missing it runs `apt-get update` and installs Debian's slurmctld, slurmd,
# slurm-client and munge (about 15 s). On any failure the trap stops what was started so far.
#
# Environment (defaults in brackets):
#   LOCAL_SLURM_DIR      state, config, logs, pid files, wrappers [/tmp/megarl-local-slurm]
#   LOCAL_SLURM_NETNS    network namespace name (multi-host: the prefix of each host's) [megarl-slurm]
#   LOCAL_SLURM_MULTIHOST  1 = each node its own namespace and address; 0 = one loopback namespace [1]
#   LOCAL_SLURM_SUBNET   private subnet of the emulated hosts [10.231.0.0/24]
#   LOCAL_SLURM_PYTHON   python3 for megarl/testing/netns.py (standard library only) [python3]
#   LOCAL_SLURM_NODES    emulated nodes, named node1..nodeN [2]
#   LOCAL_SLURM_CPUS     CPUs declared per node (may exceed the real cores) [4]
#   LOCAL_SLURM_MEM_MB   RealMemory declared per node [8192]
#   LOCAL_SLURM_GPUS     fake GPUs per node (GRES gpu:N backed by placeholder files, so jobs
#                        may request --gpus-per-node; no CUDA device exists) [0]
#   LOCAL_SLURM_PRIVATE_SHM  1 = each slurmd (and its jobs) on its own tmpfs /dev/shm; 0 = the
#                        machine's [1]
#   LOCAL_SLURM_SHM_MB   size limit of each node's /dev/shm (pages are used only when written)
#                        [the tmpfs default: half the machine's memory]
#   LOCAL_SLURM_INSTALL  1 = apt-get install the packages when missing [1]
#   LOCAL_SLURM_READY_TIMEOUT_S  seconds to wait for every node to be idle [60]
set -euo pipefail

D=${LOCAL_SLURM_DIR:-/tmp/megarl-local-slurm}
NETNS=${LOCAL_SLURM_NETNS:-megarl-slurm}
NODES=${LOCAL_SLURM_NODES:-2}
CPUS=${LOCAL_SLURM_CPUS:-4}
MEM_MB=${LOCAL_SLURM_MEM_MB:-8192}
GPUS=${LOCAL_SLURM_GPUS:-0}
INSTALL=${LOCAL_SLURM_INSTALL:-1}
READY_TIMEOUT_S=${LOCAL_SLURM_READY_TIMEOUT_S:-60}
PRIVATE_SHM=${LOCAL_SLURM_PRIVATE_SHM:-1}
SHM_MB=${LOCAL_SLURM_SHM_MB:-}
MULTIHOST=${LOCAL_SLURM_MULTIHOST:-1}
SUBNET=${LOCAL_SLURM_SUBNET:-10.231.0.0/24}
CTLD_PORT=6817
SLURMD_BASE_PORT=17000
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONF=$D/etc/slurm.conf
REPO=$(cd "$HERE/../.." && pwd)
CTL_NETNS=$NETNS  # the namespace of slurmctld (and of client commands from outside the cluster)
((MULTIHOST)) && CTL_NETNS=$NETNS-ctl
NS=(nsenter "--net=/run/netns/$CTL_NETNS")
CTL_ADDR=127.0.0.1
declare -A NODE_NETNS=() NODE_ADDR=()
T0=$SECONDS

log() { echo "[local_slurm start +$((SECONDS - T0))s] $*"; }
die() { echo "[local_slurm start] ERROR: $*" >&2; exit 1; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
    command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
  [[ $INSTALL == 1 ]] || die "Slurm/munge not installed and LOCAL_SLURM_INSTALL=$INSTALL"
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

setup_netns() {
  if ! ip netns list | awk '{print $1}' | grep -qx "$NETNS"; then
    ip netns add "$NETNS"
    echo "$NETNS" >"$D/run/netns.created"
    log "created network namespace $NETNS (loopback only)"
  fi
  "${NS[@]}" ip link set lo up
  # glibc's getaddrinfo(AI_PASSIVE|AI_ADDRCONFIG), which Slurm uses to bind, fails when the
  # only IPv4 address is 127.0.0.1; a second loopback address makes it succeed.
  "${NS[@]}" ip -4 addr show dev lo | grep -q '127\.0\.0\.2/' ||
    "${NS[@]}" ip addr add 127.0.0.2/32 dev lo
  for ((i = 1; i <= NODES; i++)); do NODE_NETNS[node$i]=$NETNS NODE_ADDR[node$i]=127.0.0.1; done
}

setup_hosts() {  # multi-host: node1..nodeN and ctl as emulated hosts (megarl/testing/netns.py)
  local names=() name netns addr out i
  for ((i = 1; i <= NODES; i++)); do names+=("node$i"); done
  names+=(ctl)
  # Recorded first: stop.sh deletes exactly these names, also after a half-made setup.
  printf '%s\n' "${names[@]/#/$NETNS-}" "$NETNS-br" >"$D/run/netns.created"
  out=$(PYTHONPATH=$REPO "${LOCAL_SLURM_PYTHON:-python3}" -m megarl.testing.netns up "$NETNS" "$SUBNET" "${names[@]}") ||
    die "could not create the emulated hosts (network namespaces and a bridge): $out"
  while read -r name netns addr; do
    if [[ $name == ctl ]]; then CTL_ADDR=$addr; else NODE_NETNS[$name]=$netns NODE_ADDR[$name]=$addr; fi
  done <<<"$out"
  log "emulated hosts on $SUBNET: $(tr '\n' ' ' <<<"$out")"
}

start_munged() {
  local m=$D/munge
  install -d -o munge -g munge -m 0700 "$m"
  if [[ ! -s $m/munge.key ]]; then
    dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$m/munge.key"
    chmod 0400 "$m/munge.key"
  fi
  runuser -u munge -- /usr/sbin/munged --force --socket="$m/munge.sock" --key-file="$m/munge.key" \
    --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed"
  for _ in $(seq 50); do [[ -s $m/munged.pid ]] && break; sleep 0.1; done
  cp "$m/munged.pid" "$D/run/munged.pid"
  munge -S "$m/munge.sock" -n | unmunge -S "$m/munge.sock" >/dev/null ||
    die "munged does not answer on $m/munge.sock (see $m/munged.log)"
  log "munged up (pid $(cat "$D/run/munged.pid"))"
}

write_conf() {
  local gres_line="" node_gres=""
  if ((GPUS > 0)); then
    # Count-only GPU GRES makes slurmd 22.05 report 0 GPUs (node INVAL): point File= at
    # placeholder files that nothing ever opens.
    mkdir -p "$D/dev"
    for ((g = 0; g < GPUS; g++)); do : >"$D/dev/fakegpu$g"; done
    printf 'AutoDetect=off\nNodeName=node[1-%d] Name=gpu File=%s/dev/fakegpu[0-%d]\n' \
      "$NODES" "$D" "$((GPUS - 1))" >"$D/etc/gres.conf"
    gres_line="GresTypes=gpu"
    node_gres=" Gres=gpu:$GPUS"
  else
    : >"$D/etc/gres.conf"
  fi
  cat >"$CONF" <<CONF_EOF
# Generated by tools/local_slurm/start.sh: ${NODES} emulated nodes on one machine.
ClusterName=megarlci
SlurmctldHost=localhost(${CTL_ADDR})
SlurmctldPort=${CTLD_PORT}
SlurmdPort=$((SLURMD_BASE_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (default 120 s, minimum 5) is also how long a requeued job waits before it may
# start again (slurm.conf(5)): the preemption test requeues a job.
AuthInfo=socket=${D}/munge/munge.sock,cred_expire=15
StateSaveLocation=${D}/state
SlurmdSpoolDir=${D}/spool/%n
SlurmctldPidFile=${D}/run/slurmctld.pid
SlurmdPidFile=${D}/run/slurmd-%n.pid
SlurmctldLogFile=${D}/log/slurmctld.log
SlurmdLogFile=${D}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, no accounting database.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
# Nodes report the configured CPUs/memory/GPUs, not what the machine has.
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# Heterogeneous jobs are started by the backfill scheduler only: run it every second, not every 30.
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s only while MinJobAge <= 4 (otherwise 2, 8, then 32 s).
MinJobAge=4
MessageTimeout=10
${gres_line}
$(for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=node$i NodeHostname=localhost NodeAddr=${NODE_ADDR[node$i]} Port=$((SLURMD_BASE_PORT + i)) CPUs=${CPUS} RealMemory=${MEM_MB}${node_gres} State=UNKNOWN"
  done)
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF_EOF
}

write_wrappers() {
  local c ours
  # Inside one of the cluster's namespaces (a job step on a node) the command runs as it is;
  # from anywhere else it enters the controller's namespace.
  ours=$(for f in $(printf '%s\n' "$CTL_NETNS" "${NODE_NETNS[@]}" | sort -u); do printf ' %s' "$(stat -L -c %i "/run/netns/$f")"; done)
  for c in sbatch srun salloc squeue scancel sinfo scontrol sacct; do
    cat >"$D/bin/$c" <<WRAP_EOF
#!/bin/sh
# $c of the local Slurm (tools/local_slurm/start.sh; controller namespace $CTL_NETNS)
export SLURM_CONF=$CONF
case " $ours " in
  *" \$(stat -L -c %i /proc/self/ns/net) "*) exec /usr/bin/$c "\$@" ;;
esac
exec nsenter --net=/run/netns/$CTL_NETNS /usr/bin/$c "\$@"
WRAP_EOF
    chmod 0755 "$D/bin/$c"
  done
  # shellcheck disable=SC2016  # $PATH is expanded when env.sh is sourced
  printf 'export SLURM_CONF=%s\nexport PATH=%s/bin:$PATH\n' "$CONF" "$D" >"$D/env.sh"
  if ((MULTIHOST)); then echo "export MEGARL_NODE_IFNAME=eth0" >>"$D/env.sh"; fi
}

start_slurmd() {  # NODE NETNS: one slurmd in the node's network namespace (and /dev/shm)
  local node=$1 netns=$2 opts=mode=1777
  local cmd=(/usr/sbin/slurmd -f "$CONF" -N "$node")
  if ((PRIVATE_SHM)); then
    [[ -z $SHM_MB ]] || opts+=,size=${SHM_MB}m
    # slurmd daemonizes inside the new mount namespace; the tmpfs is mounted before it starts.
    # shellcheck disable=SC2016  # $0 and $@ belong to the inner sh
    cmd=(unshare --mount --propagation private sh -c 'mount -t tmpfs -o "$0" tmpfs /dev/shm && exec "$@"'
      "$opts" "${cmd[@]}")
  fi
  nsenter "--net=/run/netns/$netns" "${cmd[@]}" ||
    die "slurmd $node did not start (private /dev/shm: LOCAL_SLURM_PRIVATE_SHM=$PRIVATE_SHM; logs: $D/log)"
}

wait_idle() {
  local deadline=$((SECONDS + READY_TIMEOUT_S)) nidle=0
  while ((SECONDS < deadline)); do
    # `sinfo -t idle` also matches INVALID nodes: compare the state name exactly.
    nidle=$("$D/bin/sinfo" -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l) || nidle=0
    ((nidle >= NODES)) && return 0
    sleep 0.5
  done
  "$D/bin/sinfo" -N -l >&2 || true
  tail -n 20 "$D"/log/*.log >&2 || true
  die "only $nidle of $NODES nodes became idle within ${READY_TIMEOUT_S}s (logs: $D/log)"
}

main() {
  ((EUID == 0)) || die "must run as root (network namespace, Slurm daemons)"
  if alive "$D/run/slurmctld.pid"; then
    die "a local Slurm already runs from $D (slurmctld pid $(cat "$D/run/slurmctld.pid")); run stop.sh first"
  fi
  install_packages
  mkdir -p "$D"/{etc,log,run,state,spool,bin}
  chmod go+rx "$D"  # munged runs as user munge and must reach $D/munge (mktemp dirs are 0700)
  trap 'echo "[local_slurm start] failed; stopping what was started" >&2; LOCAL_SLURM_DIR=$D "$HERE/stop.sh" >&2 || true' EXIT
  if ((MULTIHOST)); then setup_hosts; else setup_netns; fi
  start_munged
  write_conf
  write_wrappers
  "${NS[@]}" /usr/sbin/slurmctld -c -i -f "$CONF"
  local i
  for ((i = 1; i <= NODES; i++)); do
    mkdir -p "$D/spool/node$i"
    start_slurmd "node$i" "${NODE_NETNS[node$i]}"
  done
  wait_idle
  trap - EXIT
  log "ready: $NODES nodes x $CPUS CPUs (${GPUS} fake GPUs; private /dev/shm: $PRIVATE_SHM); use: source $D/env.sh"
}

main "$@"
