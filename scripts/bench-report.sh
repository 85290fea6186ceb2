#!/usr/bin/env bash
# The benchmark report: every runfeed-bench scenario at the sizes of the targets, against
# a release `runfeed serve` on a fresh database, and (optionally) the same held/fan-out scenarios
# against a BASELINE runfeed binary in the same run (before/after). Prints each table and
# writes JSON under $BENCH_OUT (default target/bench-report). Takes ~15 minutes.
#   bash scripts/bench-report.sh
#   BASELINE_BIN=/path/to/older/runfeed bash scripts/bench-report.sh
# Knobs (env): HELD_N (15000), FANOUT_F ("2000 10000"), CHURN_RATE (2000), CHURN_ENVS (1000),
# CHURN_HELD (10000), CHURN_S (20), CHURN_RUNS (10), CHURN_KIND (tag|run), STAMPEDE_K (1000), IDLE_HELD (1000), IDLE_DISTINCT (50),
# IDLE_S (300), SOURCE_ADDRS (4), ONLY ("held fanout churn stampede idle"; "cost" runs the
# cost-per-unit-of-work group: idle floor, ended polls, deliveries, changes, on a Redis of its own
# so its command counts are exact; COST_HELD (4000), COST_S (20), COST_PASSES ("floor poll delivery
# change"), COST_CHANGE_RATE (2000: the change pass's changes/s)).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET_DIR/release"
OUT="${BENCH_OUT:-$TARGET_DIR/bench-report}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
DB="runfeed_bench_$(tr -dc 'a-z0-9' </dev/urandom | head -c 10)"
DB_URL="$PG_ADMIN/$DB"
ONLY="${ONLY:-held fanout churn stampede idle}"
SRC=(--source-addrs "${SOURCE_ADDRS:-4}")
mkdir -p "$OUT"

log() { printf '[bench-report] %s\n' "$*" >&2; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
log "fd limit $(ulimit -n)"

cargo build --locked --release --bin runfeed --bin runfeed-bench || exit 1
"$BIN/runfeed" migrate --database-url "$DB_URL" >/dev/null || { log "migrate failed"; exit 1; }

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  psql "$PG_ADMIN/postgres" -qc "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_server NAME BINARY [VAR=value ...] → sets BASE, ADMIN, PID.
start_server() {
  local name=$1 bin=$2; shift 2
  local admin_port log base=""
  admin_port=$(free_port)
  log="$OUT/server-$name.log"
  : >"$log"
  env RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$admin_port" \
      RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=20000 \
      RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT=1000000 \
      RUNFEED_SERVER__HANDLE_SECRET=bench-report-secret \
      RUST_LOG=info "$@" \
      "$bin" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$log" 2>&1 &
  PID=$!
  PIDS+=("$PID")
  for _ in $(seq 1 400); do
    base=$(sed -n 's/^runfeed listening on //p' "$log" | head -n1)
    [ -n "$base" ] && break
    kill -0 "$PID" 2>/dev/null || { log "server $name exited"; cat "$log" >&2; return 1; }
    sleep 0.05
  done
  [ -n "$base" ] || { log "server $name never listened"; return 1; }
  BASE=$base
  ADMIN="http://127.0.0.1:$admin_port"
  log "server $name: $BASE (pid $PID, admin $ADMIN)"
}

stop_server() { [ -n "${PID:-}" ] || return 0; kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=""; }

bench() { # label scenario args...
  local label=$1 name=$2; shift 2
  log "== $label"
  timeout --kill-after=10 1200 "$BIN/runfeed-bench" "$name" --base-url "$BASE" \
    --database-url "$DB_URL" --redis-url "$REDIS_URL" --admin-url "$ADMIN" --server-pid "$PID" \
    "${SRC[@]}" --json "$OUT/$label.json" "$@" || log "$label FAILED"
}

want() { [[ " $ONLY " == *" $1 "* ]]; }

if want held; then
  start_server held "$BIN/runfeed" && bench held-runfeed held --n "${HELD_N:-15000}" --settle-ms 2000
  stop_server
  if [ -n "${BASELINE_BIN:-}" ]; then
    start_server held-baseline "$BASELINE_BIN" && bench held-baseline held --n "${HELD_N:-15000}" --settle-ms 2000 --no-bare
    stop_server
  fi
fi
if want fanout; then
  for f in ${FANOUT_F:-2000 10000}; do
    start_server "fanout-$f" "$BIN/runfeed" && bench "fanout-$f-runfeed" fanout --f "$f"
    stop_server
    if [ -n "${BASELINE_BIN:-}" ]; then
      start_server "fanout-$f-baseline" "$BASELINE_BIN" && bench "fanout-$f-baseline" fanout --f "$f"
      stop_server
    fi
  done
fi
if want churn; then
  # The replica gate is off here (no distinct replica). CHURN_KIND: what each held feed follows
  # (tag: one run's tag; run: the run itself). The baseline binary, if given, runs the same load.
  churn_args=(--rate "${CHURN_RATE:-2000}" --envs "${CHURN_ENVS:-1000}" --runs "${CHURN_RUNS:-10}"
    --held "${CHURN_HELD:-10000}" --duration-s "${CHURN_S:-20}" --kind "${CHURN_KIND:-tag}")
  start_server churn "$BIN/runfeed" && bench churn-runfeed churn "${churn_args[@]}"
  stop_server
  if [ -n "${BASELINE_BIN:-}" ]; then
    start_server churn-baseline "$BASELINE_BIN" && bench churn-baseline churn "${churn_args[@]}"
    stop_server
  fi
fi
if want stampede; then
  start_server stampede "$BIN/runfeed" && bench stampede stampede --k "${STAMPEDE_K:-1000}"
  stop_server
fi
if want idle; then
  start_server idle "$BIN/runfeed" && {
    bench idle-tags idle --held "${IDLE_HELD:-1000}" --distinct "${IDLE_DISTINCT:-50}" --duration-s "${IDLE_S:-300}"
    bench idle-runs idle --held "${IDLE_HELD:-1000}" --distinct "${IDLE_HELD:-1000}" --kind run --duration-s "${IDLE_S:-300}"
  }
  stop_server
fi
if want cost; then
  # A Redis of its own: `INFO commandstats` then counts only what the server sends.
  COST_REDIS_PORT=$(free_port)
  redis-server --port "$COST_REDIS_PORT" --save "" --appendonly no --bind 127.0.0.1 \
    --logfile "$OUT/cost-redis.log" &
  PIDS+=("$!")
  for _ in $(seq 1 100); do redis-cli -p "$COST_REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
  SHARED_REDIS_URL=$REDIS_URL
  REDIS_URL="redis://127.0.0.1:$COST_REDIS_PORT"
  held_n=${COST_HELD:-4000}
  cost_s=${COST_S:-20}
  cost_want() { [[ " ${COST_PASSES:-floor poll delivery change} " == *" $1 "* ]]; }
  cost_pass() { # label binary
    local label=$1 bin=$2
    # The idle floor: nothing changes and no hold expires in the window (30 s holds, no jitter).
    cost_want floor && start_server "$label-floor" "$bin" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=30000 RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO=0 &&
      bench "cost-floor-$label" idle --held "$held_n" --distinct 100 --duration-s "$cost_s"
    stop_server
    # Ended polls: every hold expires after 2 s and is polled again.
    cost_want poll && start_server "$label-poll" "$bin" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=2000 &&
      bench "cost-poll-$label" idle --held "$held_n" --distinct 100 --duration-s "$cost_s"
    stop_server
    # Deliveries: 1 000 live run feeds (200 runs × 5) at 200 changes/s, long-poll then SSE.
    cost_want delivery && start_server "$label-delivery" "$bin" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=30000 RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO=0 &&
      bench "cost-delivery-$label" churn --kind run --rate 200 --envs 20 --runs 10 --held 1000 \
        --duration-s "$cost_s" --transport both
    stop_server
    # Change records: 2 000 changes/s (COST_CHANGE_RATE) over 1 000 environments, 10 000 held tag feeds.
    cost_want change && start_server "$label-change" "$bin" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=30000 RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO=0 &&
      bench "cost-change-$label" churn --rate "${COST_CHANGE_RATE:-2000}" --envs 1000 --runs 10 --held 10000 --duration-s "$cost_s"
    stop_server
  }
  cost_pass runfeed "$BIN/runfeed"
  [ -n "${BASELINE_BIN:-}" ] && cost_pass baseline "$BASELINE_BIN"
  REDIS_URL=$SHARED_REDIS_URL
fi
log "done (JSON in $OUT)"
