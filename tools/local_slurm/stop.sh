#!/usr/bin/env bash
# Stop the local Slurm that tools/local_slurm/start.sh started, by the PIDs it recorded.
#
#   LOCAL_SLURM_DIR=/tmp/megarl-local-slurm tools/local_slurm/stop.sh
#
# Order: cancel every job of this private cluster (slurmd then ends the job steps), stop each
# slurmd, slurmctld and the private munged by pid file (TERM, then KILL after 5 s), and delete the
# network namespaces start.sh created (listed in $D/run/netns.created: one, or each emulated host's
# and the bridge's). Processes still inside them at that point can only have come from this
# cluster's jobs; they are listed and killed by PID.
# Never kills by process name. LOCAL_SLURM_PURGE=1 also removes $LOCAL_SLURM_DIR.
set -uo pipefail

D=${LOCAL_SLURM_DIR:-/tmp/megarl-local-slurm}
[[ -d $D ]] || { echo "[local_slurm stop] nothing to stop ($D does not exist)"; exit 0; }
CREATED=()
[[ -s $D/run/netns.created ]] && mapfile -t CREATED <"$D/run/netns.created"

stop_pidfile() {  # $1 = pid file, $2 = label
  local pid
  [[ -s $1 ]] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    echo "[local_slurm stop] stopping $2 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "[local_slurm stop] $2 (pid $pid) ignored TERM; KILL"
      kill -KILL "$pid" 2>/dev/null
    fi
  fi
  rm -f "$1"
}

if [[ -s $D/run/slurmctld.pid ]] && kill -0 "$(cat "$D/run/slurmctld.pid")" 2>/dev/null && [[ -x $D/bin/scancel ]]; then
  "$D/bin/scancel" --quiet --user=root 2>/dev/null
  for _ in $(seq 30); do
    [[ -z $("$D/bin/squeue" -h -o %i 2>/dev/null) ]] && break
    sleep 0.5
  done
fi
for pf in "$D"/run/slurmd-*.pid; do
  [[ -e $pf ]] && stop_pidfile "$pf" "slurmd $(basename "$pf" .pid | sed 's/^slurmd-//')"
done
stop_pidfile "$D/run/slurmctld.pid" slurmctld
stop_pidfile "$D/run/munged.pid" munged

for NETNS in "${CREATED[@]}"; do
  [[ -n $NETNS && -e /run/netns/$NETNS ]] || continue
  leftover=$(ip netns pids "$NETNS" 2>/dev/null | tr '\n' ' ')
  if [[ -n ${leftover// /} ]]; then
    echo "[local_slurm stop] killing processes left in namespace $NETNS by this cluster's jobs: $leftover"
    # shellcheck disable=SC2086  # word splitting of the PID list is intended
    kill -KILL $leftover 2>/dev/null
  fi
  ip netns delete "$NETNS" 2>/dev/null && echo "[local_slurm stop] deleted network namespace $NETNS"
done
rm -f "$D/run/netns.created"
if [[ ${LOCAL_SLURM_PURGE:-0} == 1 ]]; then
  rm -rf "$D"
fi
echo "[local_slurm stop] done"
