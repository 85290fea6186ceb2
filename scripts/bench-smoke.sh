#!/usr/bin/env bash
# Seconds-long smoke of every runfeed-bench scenario : starts `runfeed serve` on a fresh
# database (`runfeed migrate` creates it; dropped on exit), runs each scenario with tiny knobs and
# exits 0 if the tool ran every scenario. Figures are printed, never asserted.
#   bash scripts/bench-smoke.sh            # uses target/debug (builds both binaries first)
# Env: BENCH_PROFILE=release to use target/release; BENCH_OUT=DIR for the JSON files
# (default target/bench-smoke); PG_ADMIN (default postgres://postgres@127.0.0.1:5432),
# REDIS_URL (default redis://127.0.0.1:6379); SMOKE_VOLUME_RUNS (20000: the runs `gen` writes for
# the volume scenario).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
PROFILE="${BENCH_PROFILE:-debug}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET_DIR/$PROFILE"
OUT="${BENCH_OUT:-$TARGET_DIR/bench-smoke}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
DB="runfeed_bench_$(tr -dc 'a-z0-9' </dev/urandom | head -c 10)"
DB_URL="$PG_ADMIN/$DB"
mkdir -p "$OUT"

log() { printf '[bench-smoke] %s\n' "$*" >&2; }

# Many sockets: raise the soft fd limit as far as the hard limit allows.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 65536 2>/dev/null || true

if [ "$PROFILE" = release ]; then build_flags=(--release); else build_flags=(); fi
cargo build --locked "${build_flags[@]}" --bin runfeed --bin runfeed-bench || exit 1

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
  psql "$PG_ADMIN/postgres" -qc "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

"$BIN/runfeed" migrate --database-url "$DB_URL" >/dev/null || { log "migrate failed"; exit 1; }
# The data of the volume scenario, written first: `gen` fills an empty "TaskRun" (its own
# environments; the other scenarios add theirs beside them).
log "gen ${SMOKE_VOLUME_RUNS:-20000} runs"
"$BIN/runfeed-bench" gen --database-url "$DB_URL" --runs "${SMOKE_VOLUME_RUNS:-20000}" --days 2 \
  --chunk 10000 --json "$OUT/gen.json" >/dev/null || { log "gen FAILED"; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ADMIN_PORT=$(free_port)
LOG="$OUT/server.log"
: >"$LOG"   # truncate now: the background redirect below may open it after the first poll
RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$ADMIN_PORT" \
RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS="${BENCH_HOLD_MS:-20000}" \
RUNFEED_SERVER__HANDLE_SECRET="bench-smoke-secret" \
  "$BIN/runfeed" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$LOG" 2>&1 &
SERVER_PID=$!
BASE=""
for _ in $(seq 1 200); do
  BASE=$(sed -n 's/^runfeed listening on //p' "$LOG" | head -n1)
  [ -n "$BASE" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited"; cat "$LOG" >&2; exit 1; }
  sleep 0.05
done
[ -n "$BASE" ] || { log "server never listened"; cat "$LOG" >&2; exit 1; }
log "server $BASE (pid $SERVER_PID, admin 127.0.0.1:$ADMIN_PORT, db $DB)"

common=(--base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL"
  --admin-url "http://127.0.0.1:$ADMIN_PORT" --server-pid "$SERVER_PID")
FAILED=0
scenario() { # name, args...
  local name=$1; shift
  log "scenario $name"
  if ! timeout --kill-after=5 60 "$BIN/runfeed-bench" "$name" "${common[@]}" --json "$OUT/$name.json" "$@"; then
    log "scenario $name FAILED"; FAILED=1
  fi
}
scenario held --n "${SMOKE_N:-200}" --settle-ms 300 --transport both
scenario fanout --f "${SMOKE_F:-200}" --transport both
scenario churn --rate 20 --envs 2 --runs 4 --held 40 --duration-s 2 --transport both
scenario stampede --k "${SMOKE_K:-100}"
scenario idle --held 50 --distinct 5 --duration-s 2
scenario idle --held 20 --distinct 5 --kind run --duration-s 1
scenario volume --k 20 --idle-s 5 --churn-per-sec 20 --probes 3 --window 24h --explain --server-log "$LOG"
[ "$FAILED" -eq 0 ] && log "OK (JSON in $OUT)"
exit "$FAILED"
