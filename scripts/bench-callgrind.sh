#!/usr/bin/env bash
# Instructions per ended live poll, counted by valgrind's callgrind: repeatable where CPU seconds on a
# shared machine are not. Runs `runfeed serve` (release) under callgrind with a 1 s hold, parks
# HELD tag feeds with `runfeed-bench idle`, zeroes the counters once they are held, dumps them after
# WINDOW_S seconds, and divides the instructions by the polls the server answered in between.
# SCENARIO=delivery instead counts instructions per delivery: 100 live run feeds (10 runs x 5 per
# environment, 2 environments) following 20 changes/s (`runfeed-bench churn`, re-polls included),
# divided by the emissions the server made in the window.
# SCENARIO=change instead counts instructions per change record: ONE live SSE run feed per run (200
# runs: 10 per environment over 20 environments) while `runfeed-bench churn` changes them at 20
# changes/s, divided by the change records the server decoded in the window. Each record is decoded, routed, hydrated (one query,
# as the router is idle between records at this rate), serialized once and handed to its one feed,
# whose SSE stream writes it: the whole change path plus the cheapest delivery there is (no re-poll).
# It also prints, per change record, the inclusive instructions of the router's hydrate task (gate,
# query, row decode, serialization, fan-out) and of the store's query, and writes the inclusive
# profile to OUT/annotate.txt.
#   bash scripts/bench-callgrind.sh                       # target/release/runfeed
#   BIN=/path/to/other/runfeed bash scripts/bench-callgrind.sh
#   SCENARIO=delivery bash scripts/bench-callgrind.sh
#   SCENARIO=change bash scripts/bench-callgrind.sh
#   SERVER=bare bash scripts/bench-callgrind.sh           # the floor: `runfeed-bench bare` under the poll load
#   SERVER=bare BARE_ENGINE=raw bash scripts/bench-callgrind.sh   # the same without hyper (`bare --engine raw`)
# CALLGRIND_ARGS adds valgrind options, e.g. `--cache-sim=yes` (simulated cache misses per function,
# with HELD=4000 HOLD_MS=8000 SETUP_S=150 for a working set beyond the caches at a rate valgrind
# keeps up with).
# Env: BIN, BENCH (the runfeed-bench binary), CALLGRIND_ARGS, SCENARIO (poll | delivery | change), SERVER (runfeed | bare), BARE_ENGINE (hyper | raw), HELD (100), HOLD_MS (poll: 1000), SETUP_S (poll: 30, the load's
# set-up before the window), WINDOW_S (20), SERVER_LOG (the server's RUST_LOG,
# default info, the default configuration), PG_ADMIN, REDIS_URL,
# OUT (target/bench-callgrind).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="${BIN:-$TARGET_DIR/release/runfeed}"
BENCH="${BENCH:-$TARGET_DIR/release/runfeed-bench}"
HELD="${HELD:-100}"
WINDOW_S="${WINDOW_S:-20}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
OUT="${OUT:-$TARGET_DIR/bench-callgrind}"
DB="runfeed_cg_$(tr -dc 'a-z0-9' </dev/urandom | head -c 10)"
DB_URL="$PG_ADMIN/$DB"
mkdir -p "$OUT"
log() { printf '[bench-callgrind] %s\n' "$*" >&2; }
command -v valgrind >/dev/null || { log "valgrind is not installed (apt-get install valgrind)"; exit 1; }
[ -x "$BENCH" ] || cargo build --locked --release --bin runfeed-bench || exit 1
[ -x "$BIN" ] || cargo build --locked --release --bin runfeed || exit 1
"$BIN" migrate --database-url "$DB_URL" >/dev/null || { log "migrate failed"; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ADMIN_PORT=$(free_port)
LOG="$OUT/server.log"
: >"$LOG"
SCENARIO="${SCENARIO:-poll}"
case "$SCENARIO" in
  poll) HOLD_MS=${HOLD_MS:-1000}; JITTER=0.15 ;;
  delivery | change) HOLD_MS=30000; JITTER=0 ;;
  *) log "SCENARIO must be poll, delivery or change"; exit 2 ;;
esac
SERVER="${SERVER:-runfeed}"
case "$SERVER" in
  runfeed)
    RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$ADMIN_PORT" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=$HOLD_MS \
    RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO=$JITTER \
    RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT=1000000 RUNFEED_SERVER__HANDLE_SECRET=callgrind-secret RUST_LOG="${SERVER_LOG:-info}" \
      valgrind --tool=callgrind ${CALLGRIND_ARGS:-} --compress-strings=no --compress-pos=no --callgrind-out-file="$OUT/callgrind.out.%p" \
      "$BIN" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$LOG" 2>&1 &
    BANNER='s/^runfeed listening on //p' ;;
  bare)
    # The floor (`runfeed-bench bare`, scripts/bench-floor.sh) under the same poll load; it
    # answers its own /metrics.
    [ "$SCENARIO" = poll ] || { log "SERVER=bare runs the poll scenario only"; exit 2; }
    valgrind --tool=callgrind ${CALLGRIND_ARGS:-} --compress-strings=no --compress-pos=no --callgrind-out-file="$OUT/callgrind.out.%p" \
      "$BENCH" bare --engine "${BARE_ENGINE:-hyper}" --listen 127.0.0.1:0 --hold-ms "$HOLD_MS" >"$LOG" 2>&1 &
    BANNER='s/^bare listening on //p' ;;
  *) log "SERVER must be runfeed or bare"; exit 2 ;;
esac
PID=$!
cleanup() {
  kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null
  psql "$PG_ADMIN/postgres" -qc "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
BASE=""
for _ in $(seq 1 600); do
  BASE=$(sed -n "$BANNER" "$LOG" | head -n1)
  [ -n "$BASE" ] && break
  sleep 0.1
done
[ -n "$BASE" ] || { log "server never listened"; cat "$LOG" >&2; exit 1; }
ADMIN="http://127.0.0.1:$ADMIN_PORT"
[ "$SERVER" = bare ] && ADMIN="$BASE"
if [ "$SCENARIO" = poll ]; then
  # The feeds re-poll for the whole window plus their set-up.
  "$BENCH" idle --base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL" --admin-url "$ADMIN" \
    --held "$HELD" --distinct 10 --duration-s "$((WINDOW_S + ${SETUP_S:-30}))" >"$OUT/idle.txt" 2>&1 &
elif [ "$SCENARIO" = change ]; then
  HELD=200
  "$BENCH" churn --base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL" --admin-url "$ADMIN" \
    --kind run --rate 20 --envs 20 --runs 10 --held 200 --transport sse --duration-s "$((WINDOW_S + 30))" >"$OUT/churn.txt" 2>&1 &
else
  HELD=90
  "$BENCH" churn --base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL" --admin-url "$ADMIN" \
    --kind run --rate 20 --envs 2 --runs 10 --held 100 --transport "${TRANSPORT:-long-poll}" --duration-s "$((WINDOW_S + 30))" >"$OUT/churn.txt" 2>&1 &
fi
BENCH_PID=$!
for _ in $(seq 1 600); do
  held=$(curl -s "$ADMIN/metrics" | awk '/^runfeed_router_held_feeds/ { s += $NF } END { print s + 0 }')
  [ "${held%.*}" -ge "$HELD" ] && break
  sleep 0.2
done
sleep 3
answered() { curl -s "$ADMIN/metrics" | awk '/^runfeed_http_requests_total/ { s += $NF } END { print s + 0 }'; }
[ "$SERVER" = bare ] && before=$(answered)
callgrind_control -z "$PID" >/dev/null
sleep "$WINDOW_S"
callgrind_control -d "$PID" >/dev/null
[ "$SERVER" = bare ] && after=$(answered)
kill "$BENCH_PID" 2>/dev/null
sleep 1
# The last dump file holds the window's counts (the counters were zeroed at its start).
dump=$(ls -t "$OUT"/callgrind.out."$PID"* | head -n1)
ir=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
# The units are counted in the dump itself, as calls of the function that records each one
# (`Metrics::http_request` per answered request, `Metrics::emitted` per live reply, the record
# decoder per change record), not from two scrapes of the admin /metrics inside the window: a
# scrape costs as much as a few hundred polls (every series encoded), which a Prometheus pays
# every 15 s or so.
case "$SERVER:$SCENARIO" in
  bare:poll) counted=""; unit="ended poll" ;;
  *:poll) counted='runfeed::telemetry::metrics::Metrics::http_request'; unit="ended poll" ;;
  *:delivery) counted='runfeed::telemetry::metrics::Metrics::emitted'; unit="delivery" ;;
  *:change) counted='runfeed::changes::record::ChangeRecord::decode'; unit="change record" ;;
esac
# The bare server's units are its answered feed requests, read from its own /metrics just outside
# the window (that page is two counters, nothing like runfeed's).
if [ "$SERVER" = bare ]; then
  n=$(( ${after%.*} - ${before%.*} ))
else
  n=$(awk -v f="$counted" '/^cfn=/ { m = (substr($0, 5) == f) } /^calls=/ { if (m) { split($0, a, /[= ]/); s += a[2] } m = 0 } END { print s + 0 }' "$dump")
fi
if [ "$SERVER" = bare ]; then served="$BENCH bare"; else served="$BIN"; fi
log "binary $served: $ir instructions over $n units ($unit)"
awk -v ir="$ir" -v n="$n" -v u="$unit" 'BEGIN { if (n > 0) printf "instructions per %s: %.0f\n", u, ir / n }'
if [ "$SCENARIO" = change ]; then
  callgrind_annotate --inclusive=yes --threshold=100 "$dump" >"$OUT/annotate.txt" 2>/dev/null
  # Inclusive counts of the change path's own entry points (async fns are polled as closures).
  part() {
    awk -v pat="$1" -v n="$n" -v label="$2" 'index($0, pat) { gsub(",", "", $1); if ($1 + 0 > best) best = $1 + 0 }
      END { if (n > 0) printf "  of which %s: %.0f\n", label, best / n }' "$OUT/annotate.txt"
  }
  part "runfeed::router::Inner>::hydrate_batch::{{closure}} " "the hydrate task (gate, query, decode, serialize, fan-out)"
  part "<runfeed::store::pg::PgStore as runfeed::store::RunStore>::hydrate_many::{{closure}}" "the store's hydrate_many (query and row decode)"
  part "runfeed::protocol::encode::serialize_row " "serialize_row"
  part "runfeed::changes::record::ChangeRecord::decode " "the record decoder"
fi
