# shellcheck shell=bash
# The body of megarl's Slurm jobs, sourced by slurm/train.sbatch and slurm/train_hetjob.sbatch.
# Steps: probe nodes -> check the config against the allocation (before any Ray process) -> Ray
# head + workers (srun --overlap ... ray start --block, one step per node) -> wait until every node
# joined (bounded) -> run the driver while watching every node's step -> tear down by PID.
# Every variable and exit status is documented in slurm/README.md; never calls `ray stop`.

MEGARL_EXIT_INVALID=2     # the config does not fit the allocation (validation, before Ray)
MEGARL_EXIT_RAY_START=3   # the Ray cluster did not form (a node's step failed or did not join)
MEGARL_EXIT_NODE_LOST=4   # a node's Ray step ended while the driver ran
MEGARL_EXIT_PREEMPTED=75  # the driver stopped early on SIGUSR1/SIGTERM with a checkpoint (megarl.launch.preemption)

megarl_log() { echo "[megarl slurm $(date +%H:%M:%S) +$((SECONDS - MEGARL_T0))s] $*"; }

megarl_fail() {  # RC MESSAGE: log to stderr and the job dir, tear down, exit RC
  local rc=$1
  shift
  megarl_log "ERROR: $*" >&2
  echo "megarl slurm: ERROR: $*" >>"$JOB_DIR/error.txt"
  if [[ -n ${MEGARL_FAIL_MARKER:-} ]]; then echo "job $SLURM_JOB_ID: $*" >>"$MEGARL_FAIL_MARKER"; fi
  megarl_teardown
  exit "$rc"
}

megarl_init() {  # environment, job directory, defaults; must run first
  MEGARL_T0=$SECONDS
  [[ -n ${SLURM_JOB_ID:-} ]] || { echo "megarl slurm: submit this script with sbatch" >&2; exit 2; }
  if [[ -n ${MEGARL_VENV:-} ]]; then export PATH=$MEGARL_VENV/bin:$PATH; fi
  export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
  # Ray 2.60 drains a node for 30 s on SIGTERM (meant for Ray Serve); a batch job tears down now.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
  local name=${SLURM_JOB_NAME%.sbatch}
  JOB_DIR=${MEGARL_JOB_DIR:-${MEGARL_LOG_ROOT:-$SLURM_SUBMIT_DIR/runs/slurm}/$name-$SLURM_JOB_ID}
  mkdir -p "$JOB_DIR"
  export MEGARL_JOB_DIR=$JOB_DIR MEGARL_RAY_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/megarl-ray-$SLURM_JOB_ID}
  # Ray 2.60 may turn token authentication on by itself (when ~/.ray/auth_token exists) and then
  # clients without the token fail: make the mode explicit, with a token private to this job that
  # srun hands to every node through the environment.
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} ]]; then
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
  fi
  # InfiniBand clusters: NCCL finds the HCAs itself; keep its bootstrap off loopback and docker
  # bridges, and use the longer IB timeout that large jobs need. GLOO_SOCKET_IFNAME defaults, per
  # node, to the interface that holds the node's Ray address (slurm/lib/ray_node.sh).
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
  MEGARL_CONTAINER_ARGS=()
  if [[ -n ${MEGARL_CONTAINER_IMAGE:-} ]]; then  # pyxis: every Ray step and the driver in the image
    MEGARL_CONTAINER_ARGS=(--container-image="$MEGARL_CONTAINER_IMAGE" --no-container-mount-home)
    if [[ -n ${MEGARL_CONTAINER_MOUNTS:-} ]]; then MEGARL_CONTAINER_ARGS+=(--container-mounts="$MEGARL_CONTAINER_MOUNTS"); fi
    read -ra extra <<<"${MEGARL_CONTAINER_EXTRA_ARGS:-}"
    MEGARL_CONTAINER_ARGS+=("${extra[@]}")
  fi
  RAY_PIDS=()
  DRIVER_PID=""
  MEGARL_TORN_DOWN=0
  trap 'megarl_log "caught a signal: stopping"; megarl_teardown; exit 143' TERM INT
  # Slurm's early warning (#SBATCH --signal=B:USR1@SECONDS): the driver finishes its step, saves a
  # checkpoint and exits 75; the job then requeues itself. The run directory is recorded in
  # MEGARL_RESUME_FILE, so the requeued job (same id, same file) continues the run without flags.
  trap 'megarl_forward_stop USR1' USR1
  export MEGARL_RESUME_FILE=${MEGARL_RESUME_FILE:-$JOB_DIR/resume_run_dir}
  megarl_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): logs in $JOB_DIR"
}

megarl_forward_stop() {  # SIGNAL: ask the driver to checkpoint and stop after its step
  if [[ -n $DRIVER_PID ]]; then
    megarl_log "caught SIG$1: asking the driver (pid $DRIVER_PID) to save a checkpoint and stop"
    kill -"$1" "$DRIVER_PID" 2>/dev/null || true
  else
    megarl_log "caught SIG$1 before the driver started: ignored"
  fi
}

megarl_node_srun() {  # INDEX CMD...: run CMD as a one-task step on plan node INDEX
  local i=$1
  shift
  # --overlap: shares the node with the batch step and other steps; --mem=0: all of the job's
  # memory on the node (clusters that enforce memory otherwise give a step a per-CPU default).
  local args=(--overlap --nodes=1 --ntasks=1 --mem=0 --nodelist="${PLAN_HOST[i]}")
  if [[ -n ${SLURM_HET_SIZE:-} ]]; then args+=(--het-group="${PLAN_GROUP[i]}"); fi
  if ((PLAN_CPUS[i] > 0)); then args+=(--cpus-per-task="${PLAN_CPUS[i]}"); fi
  if ((NODE_GPUS[i] > 0)); then args+=(--gres=gpu:"${NODE_GPUS[i]}"); fi
  srun "${args[@]}" "$@"
}

megarl_expand_counts() {  # Slurm's per-node counts "4(x2),8" -> "4 4 8"
  local part n k j out=() parts=()
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then n=${BASH_REMATCH[1]} k=${BASH_REMATCH[2]}; else n=$part k=1; fi
    for ((j = 0; j < k; j++)); do out+=("$n"); done
  done
  echo "${out[*]}"
}

megarl_probe_nodes() {  # fill HOSTS, NODE_IP, NODE_GPUS, and the MEGARL_ALLOC_* variables
  local groups=(-) g nodelist_var cpus_var hosts_g n_g out host ip gpus i max_gpus=0
  local cpu_lists=() het=() override_ips=()
  declare -gA PROBE_IP=() PROBE_GPUS=()
  if [[ -n ${SLURM_HET_SIZE:-} ]]; then mapfile -t groups < <(seq 0 $((SLURM_HET_SIZE - 1))); fi
  HOSTS=()
  for g in "${groups[@]}"; do  # one probe step per het-job component ("-": a plain job)
    nodelist_var=SLURM_JOB_NODELIST cpus_var=SLURM_JOB_CPUS_PER_NODE
    if [[ $g != - ]]; then nodelist_var+=_HET_GROUP_$g cpus_var+=_HET_GROUP_$g; fi
    mapfile -t hosts_g < <(scontrol show hostnames "${!nodelist_var}")
    n_g=${#hosts_g[@]}
    HOSTS+=("${hosts_g[@]}")
    cpu_lists+=("${!cpus_var}")
    local srun_args=(--overlap --nodes="$n_g" --ntasks="$n_g" --ntasks-per-node=1)
    if [[ $g != - ]]; then
      srun_args+=(--het-group="$g")
      for _ in "${hosts_g[@]}"; do het+=("$g"); done
    fi
    out=$(srun "${srun_args[@]}" bash "$MEGARL_SLURM_DIR/lib/ray_node.sh" probe) ||
      megarl_fail "$MEGARL_EXIT_RAY_START" "probing the nodes failed (srun ${srun_args[*]}): $out"
    while read -r host ip _ gpus; do
      PROBE_IP[$host]=$ip
      PROBE_GPUS[$host]=$gpus
    done <<<"$out"
  done
  NODE_IP=() NODE_GPUS=() NODE_CPUS=()
  local ips=${MEGARL_NODE_IPS:-}
  read -ra override_ips <<<"${ips//,/ }"
  for i in "${!HOSTS[@]}"; do
    host=${HOSTS[i]}
    [[ -n ${PROBE_IP[$host]:-} ]] || megarl_fail "$MEGARL_EXIT_RAY_START" "node $host did not answer the probe step"
    NODE_IP[i]=${override_ips[i]:-${PROBE_IP[$host]}}
    NODE_GPUS[i]=${MEGARL_GPUS_PER_NODE:-${PROBE_GPUS[$host]}}
    ((NODE_GPUS[i] > max_gpus)) && max_gpus=${NODE_GPUS[i]}
  done
  export MEGARL_ALLOC_NODES=${#HOSTS[@]} MEGARL_ALLOC_HOSTS="${HOSTS[*]}"
  MEGARL_ALLOC_NODE_CPUS=$(IFS=,; echo "${cpu_lists[*]}")
  # shellcheck disable=SC2034  # NODE_CPUS is read by slurm/engines.sbatch
  read -ra NODE_CPUS <<<"$(megarl_expand_counts "$MEGARL_ALLOC_NODE_CPUS")"
  MEGARL_ALLOC_NODE_GPUS=$(IFS=,; echo "${NODE_GPUS[*]}")
  MEGARL_ALLOC_HET_GROUPS="${het[*]}"
  export MEGARL_ALLOC_NODE_CPUS MEGARL_ALLOC_NODE_GPUS MEGARL_ALLOC_HET_GROUPS
  # Read by megarl's validator too; unset on GPU-less jobs so CPU configs are not held to 0 GPUs.
  if ((max_gpus > 0)); then export MEGARL_ALLOC_GPUS_PER_NODE=$max_gpus; else unset MEGARL_ALLOC_GPUS_PER_NODE; fi
  megarl_log "nodes: ${HOSTS[*]} (addresses ${NODE_IP[*]}; CPUs $MEGARL_ALLOC_NODE_CPUS; GPUs $MEGARL_ALLOC_NODE_GPUS)"
}

megarl_python() {  # run python on the head node: in the container when one is configured
  if ((${#MEGARL_CONTAINER_ARGS[@]} > 0)); then
    srun --overlap --nodes=1 --ntasks=1 --nodelist="${HOSTS[0]}" "${MEGARL_CONTAINER_ARGS[@]}" python "$@"
  else
    python "$@"
  fi
}

megarl_check_config() {  # CONFIG OVERRIDES...: validate against the allocation, read the node plan
  local plan=$JOB_DIR/plan.txt rc=0
  megarl_python -m megarl.launch.slurm check --plan "$plan" --resolved "$JOB_DIR/config.yaml" "$@" \
    >"$JOB_DIR/check.log" 2>&1 || rc=$?
  if ((rc != 0)); then
    cat "$JOB_DIR/check.log" >&2
    megarl_fail "$MEGARL_EXIT_INVALID" "config $1 does not fit this allocation; Ray was not started (see above)"
  fi
  PLAN_HOST=() PLAN_GROUP=() PLAN_ROLE=() PLAN_CPUS=() PLAN_GPUS=() PLAN_RES=()
  local idx host group role cpus gpus res
  while read -r idx host group role cpus gpus res; do
    PLAN_HOST[idx]=$host PLAN_GROUP[idx]=$group PLAN_ROLE[idx]=$role
    PLAN_CPUS[idx]=$cpus PLAN_GPUS[idx]=$gpus PLAN_RES[idx]=$res
  done <"$plan"
  megarl_log "config OK; roles: $(for i in "${!PLAN_HOST[@]}"; do printf '%s=%s ' "${PLAN_HOST[i]}" "${PLAN_ROLE[i]}"; done)"
}

megarl_worker_ports() {  # INDEX -> "LO HI": distinct ranges for nodes that share an address
  local i=$1 j slot=0 base=${MEGARL_RAY_WORKER_PORT_BASE:-10002} size=${MEGARL_RAY_WORKER_PORTS_PER_NODE:-5000}
  for ((j = 0; j < i; j++)); do [[ ${NODE_IP[j]} == "${NODE_IP[i]}" ]] && slot=$((slot + 1)); done
  echo "$((base + slot * size)) $((base + (slot + 1) * size - 1))"
}

megarl_start_node() {  # INDEX ROLE(head|worker): start this node's Ray step in the background
  local i=$1 kind=$2 log ports
  log=$JOB_DIR/ray-$i-${PLAN_HOST[i]}.log
  read -r -a ports <<<"$(megarl_worker_ports "$i")"
  megarl_node_srun "$i" "${MEGARL_CONTAINER_ARGS[@]}" bash "$MEGARL_SLURM_DIR/lib/ray_node.sh" "$kind" "$i" \
    "${NODE_IP[i]}" "${PLAN_CPUS[i]}" "${PLAN_GPUS[i]}" "${PLAN_RES[i]}" "${ports[0]}" "${ports[1]}" >"$log" 2>&1 &
  RAY_PIDS[i]=$!
  printf '%s\t%s\t%s\t%s\t%s:%s/n%s/session_latest/logs\t%s\n' "$i" "${PLAN_HOST[i]}" "${NODE_IP[i]}" \
    "${PLAN_ROLE[i]}" "${PLAN_HOST[i]}" "$MEGARL_RAY_TMPDIR" "$i" "$log" >>"$JOB_DIR/nodes.tsv"
}

megarl_lost_node() {  # print the plan index of the first Ray step that has ended, or nothing
  local i
  for i in "${!RAY_PIDS[@]}"; do
    if ! kill -0 "${RAY_PIDS[i]}" 2>/dev/null; then echo "$i"; return 0; fi
  done
}

megarl_node_gone() {  # RC INDEX WHEN: fail naming the node whose step ended
  local rc=$1 i=$2 when=$3 status=0
  wait "${RAY_PIDS[i]}" || status=$?
  unset "RAY_PIDS[$i]"
  tail -n 15 "${MEGARL_STEP_LOG:-$JOB_DIR/ray}-$i-${PLAN_HOST[i]}.log" >&2 || true
  megarl_fail "$rc" "node ${PLAN_HOST[i]} (index $i, ${PLAN_ROLE[i]}, ${NODE_IP[i]}): its ${MEGARL_STEP_WHAT:-Ray step (ray start --block)} exited with status $status $when; log: ${MEGARL_STEP_LOG:-$JOB_DIR/ray}-$i-${PLAN_HOST[i]}.log"
}

megarl_start_ray() {  # head on plan node 0, workers on every other used node, wait until joined
  local timeout=${MEGARL_RAY_JOIN_TIMEOUT_S:-300} deadline i lost
  export MEGARL_RAY_PORT=${MEGARL_RAY_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
  export MEGARL_RAY_HEAD=${NODE_IP[0]}:$MEGARL_RAY_PORT
  printf 'index\thost\taddress\trole\tray_logs\tray_start_log\n' >"$JOB_DIR/nodes.tsv"
  megarl_log "starting the Ray head on ${PLAN_HOST[0]} ($MEGARL_RAY_HEAD)"
  megarl_start_node 0 head
  deadline=$((SECONDS + timeout))
  until (exec 3<>"/dev/tcp/${NODE_IP[0]}/$MEGARL_RAY_PORT") 2>/dev/null; do
    lost=$(megarl_lost_node)
    [[ -z $lost ]] || megarl_node_gone "$MEGARL_EXIT_RAY_START" "$lost" "while starting the Ray head"
    ((SECONDS < deadline)) || megarl_fail "$MEGARL_EXIT_RAY_START" "the Ray head on ${PLAN_HOST[0]} did not listen on $MEGARL_RAY_HEAD within ${timeout}s"
    sleep 0.2
  done
  for i in "${!PLAN_HOST[@]}"; do
    if ((i > 0)) && [[ ${PLAN_ROLE[i]} != unused ]]; then megarl_start_node "$i" worker; fi
    if [[ ${PLAN_ROLE[i]} == unused ]]; then megarl_log "WARNING: node ${PLAN_HOST[i]} is not used by this config"; fi
  done
  : >"$JOB_DIR/wait_nodes.log"  # a requeued job starts this log anew
  megarl_python -m megarl.launch.slurm wait-nodes --address "$MEGARL_RAY_HEAD" --plan "$JOB_DIR/plan.txt" \
    --timeout-s "$timeout" >>"$JOB_DIR/wait_nodes.log" 2>&1 &
  local waiter=$! rc=0
  while kill -0 "$waiter" 2>/dev/null; do
    lost=$(megarl_lost_node)
    if [[ -n $lost ]]; then
      kill -TERM "$waiter" 2>/dev/null
      megarl_node_gone "$MEGARL_EXIT_RAY_START" "$lost" "before every node had joined the Ray cluster"
    fi
    sleep 0.5
  done
  wait "$waiter" || rc=$?
  cat "$JOB_DIR/wait_nodes.log"
  ((rc == 0)) || megarl_fail "$MEGARL_EXIT_RAY_START" "$(tail -n 1 "$JOB_DIR/wait_nodes.log" | sed 's/^megarl slurm: //')"
  megarl_log "Ray cluster up: ${#RAY_PIDS[@]} node(s)"
}

megarl_run_driver() {  # CONFIG OVERRIDES...: run the driver, watch the nodes, return its status
  local driver rc=0 lost
  read -ra driver <<<"${MEGARL_DRIVER:-megarl train}"
  if ((${#MEGARL_CONTAINER_ARGS[@]} > 0)); then
    driver=(srun --overlap --nodes=1 --ntasks=1 --nodelist="${HOSTS[0]}" "${MEGARL_CONTAINER_ARGS[@]}" "${driver[@]}")
  fi
  megarl_log "driver: ${driver[*]} $* (log: $JOB_DIR/driver.log)"
  "${driver[@]}" "$@" > >(tee -a "$JOB_DIR/driver.log") 2>&1 &
  DRIVER_PID=$!
  while kill -0 "$DRIVER_PID" 2>/dev/null; do
    lost=$(megarl_lost_node)
    [[ -z $lost ]] || megarl_node_gone "$MEGARL_EXIT_NODE_LOST" "$lost" "while the driver ran: the node or its Ray processes failed"
    sleep "${MEGARL_MONITOR_INTERVAL_S:-1}"
  done
  wait "$DRIVER_PID" || rc=$?
  DRIVER_PID=""
  megarl_log "driver exited with status $rc"
  return "$rc"
}

megarl_stop_pids() {  # TIMEOUT_S PID...: TERM, wait up to TIMEOUT_S, then KILL
  local timeout=$1 deadline p alive
  shift
  (($# > 0)) || return 0
  kill -TERM "$@" 2>/dev/null
  deadline=$((SECONDS + timeout))
  while ((SECONDS < deadline)); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.2
  done
  kill -KILL "$@" 2>/dev/null
  return 0
}

megarl_teardown() {  # stop the driver, then every Ray step, by the PIDs this script recorded
  ((MEGARL_TORN_DOWN == 0)) || return 0
  MEGARL_TORN_DOWN=1
  if [[ -n $DRIVER_PID ]]; then
    megarl_log "stopping the driver (pid $DRIVER_PID)"
    megarl_stop_pids "${MEGARL_DRIVER_STOP_TIMEOUT_S:-15}" "$DRIVER_PID"
  fi
  if ((${#RAY_PIDS[@]} > 0)); then
    megarl_log "stopping the node steps (srun pids ${RAY_PIDS[*]})"
    megarl_stop_pids "${MEGARL_RAY_STOP_TIMEOUT_S:-30}" "${RAY_PIDS[@]}"
  fi
  wait 2>/dev/null
  if [[ -n ${MEGARL_EXTERNAL_ENGINES:-} ]]; then touch "$MEGARL_EXTERNAL_ENGINES/done"; fi
  return 0
}

megarl_external_engines() {  # print the override naming the URLs the engines job registered
  local reg=$MEGARL_EXTERNAL_ENGINES deadline=$((SECONDS + ${MEGARL_ENGINES_WAIT_S:-600}))
  megarl_log "waiting for external engines: $reg/urls.txt (slurm/engines.sbatch)" >&2
  until [[ -s $reg/urls.txt ]]; do
    if [[ -s $reg/failed ]]; then megarl_fail "$MEGARL_EXIT_RAY_START" "the engines job failed: $(tail -n 1 "$reg/failed")"; fi
    ((SECONDS < deadline)) || megarl_fail "$MEGARL_EXIT_RAY_START" "no $reg/urls.txt after ${MEGARL_ENGINES_WAIT_S:-600}s: is the engines job running?"
    sleep 1
  done
  echo "rollout.external_engine_urls=[$(paste -sd, "$reg/urls.txt")]"
}

megarl_main() {  # CONFIG OVERRIDES...: the whole job; exits with the driver's status
  (($# >= 1)) || { echo "usage: sbatch [options] $0 CONFIG [key=value ...]" >&2; exit 2; }
  local config=$1 rc=0
  shift
  megarl_init
  megarl_probe_nodes
  # The run's own directory (metrics, checkpoints) inside the job's; first, so a user override
  # still wins; cluster.ray_address last.
  local overrides=("logging.run_dir=$JOB_DIR/run" "$@")
  if [[ -n ${MEGARL_EXTERNAL_ENGINES:-} ]]; then overrides+=("$(megarl_external_engines)"); fi
  megarl_check_config "$config" "${overrides[@]}"
  megarl_start_ray
  megarl_run_driver "$config" "${overrides[@]}" "cluster.ray_address=$MEGARL_RAY_HEAD" || rc=$?
  megarl_teardown
  if ((rc == MEGARL_EXIT_PREEMPTED)) && [[ ${MEGARL_REQUEUE:-1} == 1 ]]; then
    megarl_log "the driver saved a checkpoint and stopped early: requeueing job $SLURM_JOB_ID (restart $((${SLURM_RESTART_COUNT:-0} + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || megarl_log "scontrol requeue failed: resubmit with MEGARL_RESUME_FILE=$MEGARL_RESUME_FILE to continue"
  fi
  megarl_log "done: exit status $rc"
  exit "$rc"
}
