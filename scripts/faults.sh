#!/usr/bin/env bash
# Runs one fault scenario of runfeed-faults (docs/faults.md) against a fresh `runfeed serve`
# (release build) on its own dependencies: an own PostgreSQL (scripts/pg-instance.sh on
# FAULTS_PG_PORT, 5541) and an own redis-server (FAULTS_REDIS_PORT, 7311), never the shared
# ones; everything is stopped on exit.
#
#   bash scripts/faults.sh stalled|memory|storm            [runfeed-faults flags…]
#   bash scripts/faults.sh redis    --fault restart|pause|freeze [flags…]
#   bash scripts/faults.sh postgres --fault restart|exhaust      [flags…]
#
# Env: FAULTS_SERVER_ENV="K=V …" extra environment for the server (e.g. _RJEM_MALLOC_CONF=…),
# FAULTS_PG_MAX_CONNECTIONS (200). Figures are printed; see docs/faults.md for the table.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
SCENARIO="${1:?scenario}"; shift
PG_PORT="${FAULTS_PG_PORT:-5541}"
REDIS_PORT="${FAULTS_REDIS_PORT:-7311}"
log() { printf '[faults] %s\n' "$*" >&2; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
[ -x "$BIN/runfeed" ] && [ -x "$BIN/runfeed-faults" ] || {
  log "build first: cargo build --release -p runfeed -p runfeed-dev"; exit 1; }

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  bash scripts/pg-instance.sh destroy --port "$PG_PORT" || true
}
trap cleanup EXIT

bash scripts/pg-instance.sh start --port "$PG_PORT" --max-connections "${FAULTS_PG_MAX_CONNECTIONS:-200}" >/dev/null
DB_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
"$BIN/runfeed" migrate --database-url "$DB_URL" >/dev/null

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
log "server $BASE (pid $SERVER_PID), postgres :$PG_PORT, redis :$REDIS_PORT"
common=(--base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL"
  --admin-url "http://127.0.0.1:$ADMIN_PORT" --server-pid "$SERVER_PID")
case "$SCENARIO" in
  redis) extra=(--redis-port "$REDIS_PORT") ;;
  postgres) extra=(--pg-port "$PG_PORT") ;;
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
