#!/usr/bin/env bash
# The fleet benchmark (BENCHMARKS.md "Fleet"): FEEDS live feeds held across INSTANCES runfeed instances on this
# machine (one Postgres, one Redis), by HOLDERS `runfeed-bench fleet-hold` processes on disjoint
# 127.0.0.x source addresses (one process may open at most `ulimit -Hn` files); then ONE change
# that wakes HOT of them, spread over the instances. Prints RSS and CPU per instance and the time
# from the publish to the last hot response. Not part of the test command (~2 minutes).
#   bash scripts/fleet-bench.sh
#   FEEDS=6000 HOT=1000 HOLDERS=2 bash scripts/fleet-bench.sh      # a small smoke
# Knobs (env): FEEDS (50000), HOT (10000), INSTANCES (3), HOLDERS (4), BASE_PORT (3131),
# SOURCES_PER_HOLDER (2), HOLD_WAIT_S (120), BENCH_OUT (target/fleet-bench).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET_DIR/release"
OUT="${BENCH_OUT:-$TARGET_DIR/fleet-bench}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
DB="runfeed_fleet_$(tr -dc 'a-z0-9' </dev/urandom | head -c 10)"
DB_URL="$PG_ADMIN/$DB"
FEEDS="${FEEDS:-50000}" HOT="${HOT:-10000}" INSTANCES="${INSTANCES:-3}" HOLDERS="${HOLDERS:-4}"
BASE_PORT="${BASE_PORT:-3131}" SPH="${SOURCES_PER_HOLDER:-2}" HOLD_WAIT_S="${HOLD_WAIT_S:-120}"
mkdir -p "$OUT"
rm -f "$OUT"/holder-*.json "$OUT/go"

log() { printf '[fleet-bench] %s\n' "$*" >&2; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

cargo build --locked --release --bin runfeed --bin runfeed-bench || exit 1
"$BIN/runfeed" migrate --database-url "$DB_URL" >/dev/null || { log "migrate failed"; exit 1; }

SERVER_PIDS=() HOLDER_PIDS=()
cleanup() {
  local p
  for p in "${HOLDER_PIDS[@]}" "${SERVER_PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  psql "$PG_ADMIN/postgres" -qc "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
cpu_s() { awk -v t="$(getconf CLK_TCK)" '{print ($14 + $15) / t}' "/proc/$1/stat" 2>/dev/null || echo 0; }
held_on() { curl -s "http://127.0.0.1:$1/metrics" | awk '/^runfeed_router_held_feeds[ {]/ {s += $NF} END {print s + 0}'; }

BASES=()
for i in $(seq 0 $((INSTANCES - 1))); do
  port=$((BASE_PORT + i)) admin=$((BASE_PORT + 20 + i))
  env RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$admin" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS=20000 \
      RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT=1000000 RUNFEED_SERVER__HANDLE_SECRET=fleet-bench-secret \
      RUST_LOG=warn "$BIN/runfeed" serve --listen "127.0.0.1:$port" --database-url "$DB_URL" \
      --redis-url "$REDIS_URL" >"$OUT/server-$i.log" 2>&1 &
  SERVER_PIDS+=($!)
  BASES+=("http://127.0.0.1:$port")
done
for i in $(seq 0 $((INSTANCES - 1))); do
  for _ in $(seq 1 200); do grep -q "listening on" "$OUT/server-$i.log" && break; sleep 0.05; done
done
BASE_LIST=$(IFS=,; echo "${BASES[*]}")
COMMON=(--base-url "$BASE_LIST" --database-url "$DB_URL" --redis-url "$REDIS_URL")

"$BIN/runfeed-bench" fleet-setup "${COMMON[@]}" --out "$OUT/setup.json" || exit 1
sleep 0.5
declare -A RSS0 CPU0
for i in "${!SERVER_PIDS[@]}"; do RSS0[$i]=$(rss_kib "${SERVER_PIDS[$i]}"); CPU0[$i]=$(cpu_s "${SERVER_PIDS[$i]}"); done

per_idle=$(((FEEDS - HOT) / HOLDERS)) per_hot=$((HOT / HOLDERS))
started=$(date +%s.%N)
for h in $(seq 0 $((HOLDERS - 1))); do
  "$BIN/runfeed-bench" fleet-hold "${COMMON[@]}" --setup "$OUT/setup.json" --go-file "$OUT/go" \
    --idle "$per_idle" --hot "$per_hot" --source-addrs "$SPH" --first-source $((h * SPH)) \
    --json "$OUT/holder-$h.json" >"$OUT/holder-$h.log" 2>&1 &
  HOLDER_PIDS+=($!)
done
want=$((per_idle * HOLDERS + per_hot * HOLDERS))
total=0
deadline=$((SECONDS + HOLD_WAIT_S))
while [ "$SECONDS" -lt "$deadline" ]; do
  total=0
  for i in "${!SERVER_PIDS[@]}"; do total=$((total + $(held_on $((BASE_PORT + 20 + i))))); done
  # Feeds between a response and their re-poll are not held for a moment: 97 % is "all".
  [ "$total" -ge $((want * 97 / 100)) ] && break
  sleep 0.25
done
ramp_s=$(echo "$(date +%s.%N) - $started" | bc)
log "held $total of $want feeds after ${ramp_s}s"
sleep 2
declare -A RSS1 CPU1 CPU1B HELD CPU2
for i in "${!SERVER_PIDS[@]}"; do
  RSS1[$i]=$(rss_kib "${SERVER_PIDS[$i]}"); CPU1[$i]=$(cpu_s "${SERVER_PIDS[$i]}")
  HELD[$i]=$(held_on $((BASE_PORT + 20 + i)))
done
# A quiet window: the CPU the held feeds cost while nothing changes (re-polls as holds expire).
t1=$(date +%s.%N); sleep 3; t1b=$(date +%s.%N)
for i in "${!SERVER_PIDS[@]}"; do CPU1B[$i]=$(cpu_s "${SERVER_PIDS[$i]}"); done

"$BIN/runfeed-bench" fleet-change "${COMMON[@]}" --setup "$OUT/setup.json" --go-file "$OUT/go" || exit 1
# The holders exit once every hot feed has its response (their idle feeds are dropped then).
for p in "${HOLDER_PIDS[@]}"; do wait "$p"; done
t2=$(date +%s.%N)
for i in "${!SERVER_PIDS[@]}"; do CPU2[$i]=$(cpu_s "${SERVER_PIDS[$i]}"); done
HOLDER_PIDS=()
quiet=$(echo "$t1b - $t1" | bc) wake=$(echo "$t2 - $t1b" | bc)

printf '\nfleet  feeds=%s hot=%s instances=%s holders=%s (all held: %s of %s, ramp %.1f s)\n' \
  "$FEEDS" "$HOT" "$INSTANCES" "$HOLDERS" "$total" "$want" "$ramp_s"
printf '%-9s %8s %10s %10s %13s %12s %16s %18s\n' instance held "RSS0 MiB" "RSS MiB" "KiB/held" "CPU ramp s" "CPU quiet %core" "CPU wake s (net)"
for i in "${!SERVER_PIDS[@]}"; do
  awk -v i="$i" -v h="${HELD[$i]}" -v r0="${RSS0[$i]}" -v r1="${RSS1[$i]}" -v c0="${CPU0[$i]}" -v c1="${CPU1[$i]}" \
      -v c1b="${CPU1B[$i]}" -v c2="${CPU2[$i]}" -v q="$quiet" -v w="$wake" \
    'BEGIN {rate = (c1b-c1)/q; printf "%-9s %8d %10.1f %10.1f %13.2f %12.2f %16.1f %18.3f\n", i, h, r0/1024, r1/1024, (h > 0 ? (r1-r0)/h : 0), c1-c0, 100*rate, (c2-c1b) - rate*w}'
done
printf 'wake window (publish to the last holder exiting): %.3f s\n' "$wake"
python3 - "$OUT" "$HOLDERS" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = [json.load(open(f"{out}/holder-{h}.json"))["figures"] for h in range(n)]
got = sum(r["hot responses"] for r in rows)
err = sum(r["hot errors"] for r in rows)
worst = max(r["publish -> response max (ms)"] for r in rows)
p99 = max(r["publish -> response p99 (ms)"] for r in rows)
print(f"hot responses {got}, errors {err}; publish -> response p99 (worst holder) {p99:.1f} ms; last response {worst:.1f} ms")
PY
