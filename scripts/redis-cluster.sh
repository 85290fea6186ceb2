#!/usr/bin/env bash
# A throwaway local Redis Cluster (3 masters, no replicas unless asked) for the cluster tests
# (tests/it/changes_cluster.rs), the failover scenario of runfeed-faults and for trying runfeed's
# sharded pub/sub by hand.
#
#   bash scripts/redis-cluster.sh start  [--base-port P] [--replicas R]  # prints REDIS_CLUSTER_URL=redis-cluster://127.0.0.1:P?node=…
#   bash scripts/redis-cluster.sh status [--base-port P]   # exit 0 when cluster_state:ok, 3 otherwise
#   bash scripts/redis-cluster.sh restart-node N [--base-port P] [--down-ms MS]
#   bash scripts/redis-cluster.sh failover N [--base-port P] [--mode kill|takeover]
#   bash scripts/redis-cluster.sh stop   [--base-port P]
#
# start: runs `redis-server` on 127.0.0.1 ports P, P+1, P+2 (default P = 7100) with
# `cluster-enabled yes`, no persistence (`--save "" --appendonly no`) and
# `cluster-require-full-coverage no` (the other shards keep serving while one master is down),
# each in its own directory /tmp/runfeed-redis-cluster-P/node-<port> (config, nodes.conf, log),
# joins them with `redis-cli --cluster create … --cluster-replicas 0 --cluster-yes` and waits
# until every node reports cluster_state:ok. A cluster left on the same ports by an earlier run is
# stopped and replaced first, so `start` is idempotent. `--replicas R` (0 or 1, default 0) adds
# one replica per master on ports P+3, P+4, P+5 (`--cluster-replicas 1`); the other commands read
# the layout back from the cluster's directory.
# restart-node N: N is the node index 1..3 (port P+N-1) or a port; `SHUTDOWN NOSAVE` on it, waits
# until it is gone, sleeps MS (default 0), starts it again from its directory (its nodes.conf
# keeps its node id and slots) and waits for cluster_state:ok on every node.
# failover N: N is a master (index or port) that has a replica. `--mode kill` (default):
# `SHUTDOWN NOSAVE` on the master, waits until its replica is promoted (after
# cluster-node-timeout, 5 s) and every live node reports cluster_state:ok, then starts the old
# master again, which rejoins as a replica of the new one. `--mode takeover`:
# `CLUSTER FAILOVER TAKEOVER` on the replica (no node goes down). Prints PROMOTED=<port> of the
# new master and waits for cluster_state:ok on every node.
# stop: kills the servers (SHUTDOWN NOSAVE, then SIGKILL) and removes the directory.
#
# Every wait is bounded by REDIS_CLUSTER_TIMEOUT seconds (default 30).
set -euo pipefail

TIMEOUT="${REDIS_CLUSTER_TIMEOUT:-30}"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] && [ "$TIMEOUT" -ge 5 ] || TIMEOUT=5
HOST=127.0.0.1
NODES=3

log() { printf '[redis-cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

CMD="${1:-}"
[ -n "$CMD" ] || usage
shift
NODE_ARG=""
if [ "$CMD" = restart-node ] || [ "$CMD" = failover ]; then
  NODE_ARG="${1:-}"
  [ -n "$NODE_ARG" ] || die "$CMD needs a node index (1..$NODES) or a port"
  shift
fi
BASE_PORT=7100
DOWN_MS=0
REPLICAS=""
MODE=kill
while [ $# -gt 0 ]; do
  case "$1" in
    --base-port) BASE_PORT="${2:?--base-port needs a value}"; shift 2 ;;
    --base-port=*) BASE_PORT="${1#*=}"; shift ;;
    --down-ms) DOWN_MS="${2:?--down-ms needs a value}"; shift 2 ;;
    --down-ms=*) DOWN_MS="${1#*=}"; shift ;;
    --replicas) REPLICAS="${2:?--replicas needs a value}"; shift 2 ;;
    --replicas=*) REPLICAS="${1#*=}"; shift ;;
    --mode) MODE="${2:?--mode needs a value}"; shift 2 ;;
    --mode=*) MODE="${1#*=}"; shift ;;
    -h|--help) usage ;;
    *) die "unknown argument $1" ;;
  esac
done
if ! [[ "$BASE_PORT" =~ ^[0-9]+$ ]] || [ "$BASE_PORT" -lt 1024 ] || [ "$BASE_PORT" -gt 65000 ]; then
  die "--base-port must be a port number in 1024..65000"
fi
[[ "$DOWN_MS" =~ ^[0-9]+$ ]] || die "--down-ms must be a number of milliseconds"
case "$MODE" in kill|takeover) ;; *) die "--mode must be kill or takeover" ;; esac
command -v redis-server >/dev/null 2>&1 || die "redis-server not found (apt-get install redis-server)"
command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found (apt-get install redis-tools)"

DIR="${TMPDIR:-/tmp}/runfeed-redis-cluster-$BASE_PORT"
if [ -z "$REPLICAS" ]; then
  if [ "$CMD" != start ] && [ -f "$DIR/replicas" ]; then REPLICAS=$(cat "$DIR/replicas"); else REPLICAS=0; fi
fi
case "$REPLICAS" in 0|1) ;; *) die "--replicas must be 0 or 1" ;; esac
MASTERS=$NODES
NODES=$((MASTERS * (REPLICAS + 1)))
PORTS=()
for ((i = 0; i < NODES; i++)); do PORTS+=($((BASE_PORT + i))); done

cli() { # port, args...
  local port=$1; shift
  timeout 5 redis-cli -h "$HOST" -p "$port" "$@" 2>/dev/null
}

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# Polls `command…` every 0.1 s until it succeeds; dies after TIMEOUT seconds.
wait_for() { # what, command...
  local what=$1; shift
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      local port
      for port in "${PORTS[@]}"; do
        [ -f "$DIR/node-$port/redis.log" ] && { log "last lines of node $port:"; tail -n 5 "$DIR/node-$port/redis.log" >&2; }
      done
      die "$what: not within ${TIMEOUT}s"
    fi
    sleep 0.1
  done
}

node_dir() { echo "$DIR/node-$1"; }

write_config() { # port
  local port=$1 dir
  dir=$(node_dir "$port")
  mkdir -p "$dir"
  cat >"$dir/redis.conf" <<EOF
# Written by runfeed scripts/redis-cluster.sh (a throwaway test cluster node).
port $port
bind $HOST
protected-mode no
daemonize yes
pidfile $dir/redis.pid
logfile $dir/redis.log
dir $dir
save ""
appendonly no
cluster-enabled yes
cluster-config-file nodes.conf
cluster-node-timeout 5000
cluster-require-full-coverage no
cluster-allow-reads-when-down yes
EOF
}

start_node() { # port
  local port=$1 dir
  dir=$(node_dir "$port")
  port_open "$port" && die "port $port is in use by something other than this cluster"
  redis-server "$dir/redis.conf" >/dev/null 9>&- || die "redis-server on port $port did not start (see $dir/redis.log)"
  wait_for "node $port answering PING" ping_ok "$port"
}

ping_ok() { [ "$(cli "$1" ping)" = PONG ]; }
port_closed() { ! port_open "$1"; }

node_pid() { # port
  local pidfile
  pidfile="$(node_dir "$1")/redis.pid"
  if [ -f "$pidfile" ]; then cat "$pidfile" 2>/dev/null || true; fi
}

kill_node() { # port: SHUTDOWN NOSAVE, then SIGKILL of the pid from its pidfile
  local port=$1 pid
  pid=$(node_pid "$port")
  if port_open "$port"; then
    cli "$port" shutdown nosave >/dev/null || true
  fi
  local deadline=$((SECONDS + 10))
  while port_open "$port" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    # Only a redis-server of ours: the pid file lives in our directory.
    if grep -q redis-server "/proc/$pid/cmdline" 2>/dev/null; then
      log "node $port (pid $pid) still running; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait_for "node $port gone" port_closed "$port"
  rm -f "$(node_dir "$port")/redis.pid"
}

cluster_ok() { # every node (but the ports given) says cluster_state:ok and knows all slots
  local port info
  for port in "${PORTS[@]}"; do
    [[ " $* " == *" $port "* ]] && continue
    info=$(cli "$port" cluster info) || return 1
    grep -q '^cluster_state:ok' <<<"$info" || return 1
    grep -q '^cluster_slots_ok:16384' <<<"$info" || return 1
    grep -q "^cluster_known_nodes:$NODES" <<<"$info" || return 1
    # With replicas and no node left out: every master has its replica attached.
    if [ "$REPLICAS" -gt 0 ] && [ $# -eq 0 ]; then
      [ "$(cli "$port" cluster nodes | awk '$3 ~ /slave/ && $3 !~ /fail/ && $8 == "connected"' | wc -l)" -ge $((MASTERS * REPLICAS)) ] || return 1
    fi
  done
}

url() {
  local out="redis-cluster://$HOST:${PORTS[0]}" sep='?' port
  for port in "${PORTS[@]:1}"; do
    out+="${sep}node=$HOST:$port"
    sep='&'
  done
  echo "$out"
}

stop_cluster() {
  local port
  for port in "${PORTS[@]}"; do
    if [ -d "$(node_dir "$port")" ] || port_open "$port"; then
      # Never touch a server that is not ours.
      if [ ! -d "$(node_dir "$port")" ]; then
        log "port $port is in use by something other than this cluster; leaving it"
        continue
      fi
      kill_node "$port"
    fi
  done
  rm -rf "$DIR"
}

start_cluster() {
  local t0=$SECONDS port
  if [ -d "$DIR" ]; then
    log "a cluster from an earlier run is on ports ${PORTS[*]}; replacing it"
    stop_cluster
  fi
  for port in "${PORTS[@]}"; do
    port_open "$port" && die "port $port is in use by something other than this cluster"
  done
  READY=0
  trap 'if [ "$READY" != 1 ]; then log "start failed; removing the cluster"; stop_cluster; fi' EXIT
  for port in "${PORTS[@]}"; do
    write_config "$port"
    start_node "$port"
  done
  echo "$REPLICAS" >"$DIR/replicas"
  local addrs=()
  for port in "${PORTS[@]}"; do addrs+=("$HOST:$port"); done
  log "creating the cluster on ${addrs[*]}"
  if ! timeout "$TIMEOUT" redis-cli --cluster create "${addrs[@]}" --cluster-replicas "$REPLICAS" --cluster-yes \
      >"$DIR/create.log" 2>&1; then
    cat "$DIR/create.log" >&2 || true
    die "redis-cli --cluster create failed"
  fi
  wait_for "cluster_state:ok on every node" cluster_ok
  READY=1
  log "cluster ready in $((SECONDS - t0))s (ports ${PORTS[*]}, dir $DIR)"
  echo "REDIS_CLUSTER_URL=$(url)"
}

node_port() { # NODE_ARG (an index 1..NODES or a port) → port
  if [[ "$NODE_ARG" =~ ^[0-9]+$ ]] && [ "$NODE_ARG" -ge 1 ] && [ "$NODE_ARG" -le "$NODES" ]; then
    echo $((BASE_PORT + NODE_ARG - 1))
  elif [[ "$NODE_ARG" =~ ^[0-9]+$ ]] && [ "$NODE_ARG" -ge "$BASE_PORT" ] && [ "$NODE_ARG" -lt $((BASE_PORT + NODES)) ]; then
    echo "$NODE_ARG"
  else
    die "node $NODE_ARG is neither an index 1..$NODES nor one of the ports ${PORTS[*]}"
  fi
}

restart_node() {
  local port
  port=$(node_port)
  [ -f "$(node_dir "$port")/redis.conf" ] || die "no cluster on ports ${PORTS[*]} (start it first)"
  local t0=$SECONDS
  log "stopping node $port (SHUTDOWN NOSAVE)"
  kill_node "$port"
  if [ "$DOWN_MS" -gt 0 ]; then
    sleep "$(awk -v ms="$DOWN_MS" 'BEGIN { printf "%.3f", ms / 1000 }')"
  fi
  log "starting node $port again"
  start_node "$port"
  wait_for "cluster_state:ok on every node" cluster_ok
  log "node $port back in $((SECONDS - t0))s"
}

is_master() { cli "$1" role | head -n1 | grep -qx master; }

# The port of a replica of the master on `port` (from CLUSTER NODES of that master).
replica_of() { # port
  local id
  id=$(cli "$1" cluster myid) || return 1
  cli "$1" cluster nodes | awk -v id="$id" '$3 ~ /slave/ && $4 == id && $3 !~ /fail/ { split($2, a, "[:@]"); print a[2]; exit }'
}

failover_node() {
  local port replica t0=$SECONDS
  port=$(node_port)
  [ -f "$(node_dir "$port")/redis.conf" ] || die "no cluster on ports ${PORTS[*]} (start it first)"
  is_master "$port" || die "node $port is not a master"
  replica=$(replica_of "$port")
  [ -n "$replica" ] || die "master $port has no replica (start the cluster with --replicas 1)"
  if [ "$MODE" = takeover ]; then
    log "CLUSTER FAILOVER TAKEOVER on $replica (replica of $port)"
    [ "$(cli "$replica" cluster failover takeover)" = OK ] || die "CLUSTER FAILOVER TAKEOVER on $replica failed"
    wait_for "replica $replica promoted" is_master "$replica"
  else
    log "killing master $port (SHUTDOWN NOSAVE); its replica is $replica"
    kill_node "$port"
    wait_for "replica $replica promoted" is_master "$replica"
    wait_for "cluster_state:ok on every live node" cluster_ok "$port"
    log "replica $replica promoted in $((SECONDS - t0))s; starting $port again"
    start_node "$port"
  fi
  wait_for "cluster_state:ok on every node" cluster_ok
  log "failover of $port done in $((SECONDS - t0))s"
  echo "PROMOTED=$replica"
}

status_cluster() {
  if cluster_ok; then
    echo "REDIS_CLUSTER_URL=$(url)"
    return 0
  fi
  echo "not running or not ok (ports ${PORTS[*]})"
  return 3
}

# One command per cluster at a time.
lock() {
  mkdir -p "${TMPDIR:-/tmp}"
  exec 9>"${TMPDIR:-/tmp}/runfeed-redis-cluster-$BASE_PORT.lock"
  flock -w "$TIMEOUT" 9 || die "another scripts/redis-cluster.sh holds the lock of ports ${PORTS[*]}"
}

case "$CMD" in
  start) lock; start_cluster ;;
  stop) lock; stop_cluster; log "stopped (ports ${PORTS[*]})" ;;
  restart-node) lock; restart_node ;;
  failover) lock; failover_node ;;
  status) status_cluster ;;
  *) usage ;;
esac
