#!/usr/bin/env bash
# Runs one fault scenario of runfeed-faults (docs/faults.md) against a fresh `runfeed serve`
# (release build) on its own dependencies: an own PostgreSQL (scripts/pg-instance.sh on
# FAULTS_PG_PORT, 5541) and an own redis-server (FAULTS_REDIS_PORT, 7311), never the shared
# ones; everything is stopped on exit.
#
#   bash scripts/faults.sh stalled|memory|storm            [runfeed-faults flags…]
#   bash scripts/faults.sh redis    --fault restart|pause|freeze [flags…]
#   bash scripts/faults.sh redis-failover [--mode kill|takeover]  [flags…]
#   bash scripts/faults.sh postgres --fault restart|exhaust|freeze [flags…]
#   bash scripts/faults.sh replica  --fault restart|promote      [flags…]
#
# Env: FAULTS_SERVER_ENV="K=V …" extra environment for the server (e.g. _RJEM_MALLOC_CONF=…),
# FAULTS_PG_MAX_CONNECTIONS (200). redis-failover runs the server against a Redis Cluster of 3
# masters with one replica each (scripts/redis-cluster.sh on FAULTS_CLUSTER_PORT, 7321) instead;
# replica gives the server a streaming replica of its PostgreSQL (scripts/replica.sh on
# FAULTS_REPLICA_PORT, 5542) as its read replica. Figures are printed; see docs/faults.md for the table.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
SCENARIO="${1:?scenario}"; shift
PG_PORT="${FAULTS_PG_PORT:-5541}"
REDIS_PORT="${FAULTS_REDIS_PORT:-7311}"
CLUSTER_PORT="${FAULTS_CLUSTER_PORT:-7321}"
REPLICA_PORT="${FAULTS_REPLICA_PORT:-5542}"
log() { printf '[faults] %s\n' "$*" >&2; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
[ -x "$BIN/runfeed" ] && [ -x "$BIN/runfeed-faults" ] || {
  log "build first: cargo build --release -p runfeed -p runfeed-dev"; exit 1; }

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  [ "$SCENARIO" != redis-failover ] || bash scripts/redis-cluster.sh stop --base-port "$CLUSTER_PORT" >/dev/null 2>&1 || true
  [ "$SCENARIO" != replica ] || bash scripts/replica.sh stop --port "$REPLICA_PORT" >/dev/null 2>&1 || true
  bash scripts/pg-instance.sh destroy --port "$PG_PORT" || true
}
trap cleanup EXIT

bash scripts/pg-instance.sh start --port "$PG_PORT" --max-connections "${FAULTS_PG_MAX_CONNECTIONS:-200}" >/dev/null
DB_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
if [ "$SCENARIO" = redis-failover ]; then
  REDIS_URL=$(bash scripts/redis-cluster.sh start --base-port "$CLUSTER_PORT" --replicas 1 | sed -n 's/^REDIS_CLUSTER_URL=//p')
  FAULTS_SERVER_ENV="RUNFEED_REDIS__CLUSTER=true ${FAULTS_SERVER_ENV:-}"
else
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
  for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
fi
"$BIN/runfeed" migrate --database-url "$DB_URL" >/dev/null
if [ "$SCENARIO" = replica ]; then
  REPLICA_URL=$(bash scripts/replica.sh start --port "$REPLICA_PORT" --primary-port "$PG_PORT" | sed -n 's/^REPLICA_URL=//p')
  FAULTS_SERVER_ENV="RUNFEED_DATABASE__REPLICA_URL=$REPLICA_URL ${FAULTS_SERVER_ENV:-}"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
# start_server LOGFILE ADMIN_PORT → sets BASE, SERVER_PID
start_server() {
  : >"$1"
  env RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$2" \
      RUNFEED_SERVER__HANDLE_SECRET="faults-secret" \
      RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT=1000000 \
      RUST_LOG="${RUST_LOG:-warn}" ${FAULTS_SERVER_ENV:-} \
    "$BIN/runfeed" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$1" 2>&1 &
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  BASE=""
  for _ in $(seq 1 200); do
    BASE=$(sed -n 's/^runfeed listening on //p' "$1" | head -n1)
    [ -n "$BASE" ] && break
    sleep 0.05
  done
  [ -n "$BASE" ] || { log "server never listened"; cat "$1" >&2; exit 1; }
}
ADMIN_PORT=$(free_port)
start_server "${TMPDIR:-/tmp}/runfeed-faults-server.log" "$ADMIN_PORT"
log "server $BASE (pid $SERVER_PID), postgres :$PG_PORT, redis $REDIS_URL"
common=(--base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL"
  --admin-url "http://127.0.0.1:$ADMIN_PORT" --server-pid "$SERVER_PID")
case "$SCENARIO" in
  redis) extra=(--redis-port "$REDIS_PORT") ;;
  redis-failover) extra=(--cluster-base-port "$CLUSTER_PORT") ;;
  postgres) extra=(--pg-port "$PG_PORT") ;;
  replica) extra=(--replica-port "$REPLICA_PORT") ;;
  storm)
    # The clients reconnect to a second instance (as after a deploy).
    FIRST_BASE=$BASE; FIRST_PID=$SERVER_PID
    ADMIN2=$(free_port)
    start_server "${TMPDIR:-/tmp}/runfeed-faults-server2.log" "$ADMIN2"
    log "second instance $BASE (pid $SERVER_PID)"
    extra=(--storm-base-url "$BASE" --storm-admin-url "http://127.0.0.1:$ADMIN2")
    BASE=$FIRST_BASE; SERVER_PID=$FIRST_PID ;;
  *) extra=() ;;
esac
"$BIN/runfeed-faults" "$SCENARIO" "${common[@]}" "${extra[@]}" "$@"
