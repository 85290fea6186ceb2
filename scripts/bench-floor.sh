#!/usr/bin/env bash
# The floor of an ended live poll: server CPU per answered request of `runfeed serve` against
# `runfeed-bench bare` (hyper's HTTP/1.1 and a timer, served like runfeed, nothing else) under the
# same `runfeed-bench idle` load: HELD held tag feeds over DISTINCT tags, HOLD_MS holds, each
# re-polled as soon as its hold ends. For each server it waits until the feeds are held, then
# reads the server's user and system CPU time (/proc/<pid>/stat) and its answered requests
# (`runfeed_http_requests_total`; the bare server exports the same name) over WINDOW_S seconds.
# The two servers alternate over ROUNDS rounds (the order flips each round): these machines are
# shared and their speed drifts.
#   bash scripts/bench-floor.sh
#   ROUNDS=5 WINDOW_S=30 bash scripts/bench-floor.sh
#   STRACE=1 bash scripts/bench-floor.sh      # also system calls per request (strace -c -f)
#   RAW=1 bash scripts/bench-floor.sh         # also `runfeed-bench bare --engine raw` (no hyper)
#   BEFORE_BIN=/path/to/old/runfeed bash scripts/bench-floor.sh   # also a second runfeed build
#                                             # (a before/after pair in one run)
# Env: BIN (target/release/runfeed), BENCH (target/release/runfeed-bench), ROUNDS (3), WINDOW_S
# (15), SETTLE_S (3, after all feeds are held), HELD (4000), DISTINCT (100), SOURCE_ADDRS (4),
# HOLD_MS (2000), STRACE (0), STRACE_S (10), RAW (0), BEFORE_BIN (none), SERVER_LOG (runfeed's RUST_LOG, default info),
# PG_ADMIN, REDIS_URL, OUT (target/bench-floor).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="${BIN:-$TARGET_DIR/release/runfeed}"
BENCH="${BENCH:-$TARGET_DIR/release/runfeed-bench}"
ROUNDS="${ROUNDS:-3}"
WINDOW_S="${WINDOW_S:-15}"
SETTLE_S="${SETTLE_S:-3}"
HELD="${HELD:-4000}"
DISTINCT="${DISTINCT:-100}"
SOURCE_ADDRS="${SOURCE_ADDRS:-4}"
HOLD_MS="${HOLD_MS:-2000}"
STRACE="${STRACE:-0}"
STRACE_S="${STRACE_S:-10}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
OUT="${OUT:-$TARGET_DIR/bench-floor}"
DB="runfeed_floor_$(tr -dc 'a-z0-9' </dev/urandom | head -c 10)"
DB_URL="$PG_ADMIN/$DB"
mkdir -p "$OUT"
log() { printf '[bench-floor] %s\n' "$*" >&2; }

# Two processes hold HELD sockets each: raise the soft fd limit as far as the hard limit allows.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((HELD + 1000)) ]; then
  log "ulimit -n is $(ulimit -n) (hard $(ulimit -Hn)): too low for HELD=$HELD"
  exit 1
fi
if [ "$STRACE" = 1 ]; then
  command -v strace >/dev/null || { log "strace is not installed (apt-get install strace)"; exit 1; }
fi
[ -x "$BENCH" ] || cargo build --locked --release --bin runfeed-bench || exit 1
[ -x "$BIN" ] || cargo build --locked --release --bin runfeed || exit 1
"$BIN" migrate --database-url "$DB_URL" >/dev/null || { log "migrate failed"; exit 1; }

PID="" BENCH_PID=""
stop() {
  if [ -n "$BENCH_PID" ]; then kill "$BENCH_PID" 2>/dev/null; wait "$BENCH_PID" 2>/dev/null; BENCH_PID=""; fi
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=""; fi
}
cleanup() {
  stop
  psql "$PG_ADMIN/postgres" -qc "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
TICKS=$(getconf CLK_TCK)

# start NAME → sets PID, BASE, ADMIN.
start() {
  local name=$1 logf="$OUT/server-$1.log" banner
  : >"$logf"
  if [ "$name" = runfeed ] || [ "$name" = before ]; then
    local admin_port bin="$BIN"
    [ "$name" = before ] && bin="$BEFORE_BIN"
    admin_port=$(free_port)
    RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$admin_port" RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS="$HOLD_MS" \
    RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT=1000000 RUNFEED_SERVER__HANDLE_SECRET=bench-floor-secret \
    RUST_LOG="${SERVER_LOG:-info}" \
      "$bin" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$logf" 2>&1 &
    PID=$!
    banner='s/^runfeed listening on //p'
    ADMIN="http://127.0.0.1:$admin_port"
  else
    local engine=hyper
    [ "$name" = raw ] && engine=raw
    "$BENCH" bare --engine "$engine" --listen 127.0.0.1:0 --hold-ms "$HOLD_MS" >"$logf" 2>&1 &
    PID=$!
    banner='s/^bare listening on //p'
  fi
  BASE=""
  for _ in $(seq 1 400); do
    BASE=$(sed -n "$banner" "$logf" | head -n1)
    [ -n "$BASE" ] && break
    kill -0 "$PID" 2>/dev/null || { log "$name exited"; cat "$logf" >&2; return 1; }
    sleep 0.05
  done
  [ -n "$BASE" ] || { log "$name never listened"; return 1; }
  # The bare server answers its own /metrics.
  [ "$name" = runfeed ] || [ "$name" = before ] || ADMIN="$BASE"
}

metric() { curl -s "$ADMIN/metrics" | awk -v n="$1" '$1 == n || index($1, n "{") == 1 { s += $NF } END { print s + 0 }'; }
# utime and stime of $PID, in clock ticks (fields 14 and 15 of /proc/<pid>/stat).
cpu_ticks() { sed 's/.*) //' "/proc/$PID/stat" | awk '{ print $12, $13 }'; }

RESULTS="$OUT/results.txt"
: >"$RESULTS"

# pass ROUND NAME: one measured window of one server; appends "ROUND NAME REQS USER_US SYS_US [SYSCALLS]".
pass() {
  local round=$1 name=$2
  start "$name" || return 1
  local extra=$((SETTLE_S + WINDOW_S + 5))
  [ "$STRACE" = 1 ] && extra=$((extra + STRACE_S + 2))
  "$BENCH" idle --base-url "$BASE" --database-url "$DB_URL" --redis-url "$REDIS_URL" --admin-url "$ADMIN" \
    --server-pid "$PID" --held "$HELD" --distinct "$DISTINCT" --kind tag --source-addrs "$SOURCE_ADDRS" \
    --duration-s "$extra" >"$OUT/idle-$round-$name.txt" 2>&1 &
  BENCH_PID=$!
  local held=0
  for _ in $(seq 1 900); do
    held=$(metric runfeed_router_held_feeds)
    [ "${held%.*}" -ge "$HELD" ] && break
    kill -0 "$BENCH_PID" 2>/dev/null || break
    sleep 0.2
  done
  if [ "${held%.*}" -lt "$HELD" ]; then
    log "round $round $name: only $held feeds held"; cat "$OUT/idle-$round-$name.txt" >&2; stop; return 1
  fi
  sleep "$SETTLE_S"
  local r0 r1 u0 s0 u1 s1 t0 t1
  r0=$(metric runfeed_http_requests_total)
  read -r u0 s0 < <(cpu_ticks)
  t0=$(date +%s.%N)
  sleep "$WINDOW_S"
  r1=$(metric runfeed_http_requests_total)
  read -r u1 s1 < <(cpu_ticks)
  t1=$(date +%s.%N)
  local syscalls=""
  if [ "$STRACE" = 1 ]; then
    # Every thread of the server, counted for STRACE_S seconds; slow under ptrace, but the counts
    # per request hold.
    local tids=() q0 q1
    for t in /proc/"$PID"/task/*; do tids+=(-p "${t##*/}"); done
    q0=$(metric runfeed_http_requests_total)
    timeout -s INT "$STRACE_S" strace -c -f -o "$OUT/strace-$round-$name.txt" "${tids[@]}" 2>/dev/null
    q1=$(metric runfeed_http_requests_total)
    local calls
    calls=$(awk '$NF == "total" { print $4 }' "$OUT/strace-$round-$name.txt")
    syscalls=$(awk -v c="${calls:-0}" -v n="$((${q1%.*} - ${q0%.*}))" 'BEGIN { if (n > 0) printf "%.2f", c / n }')
  fi
  wait "$BENCH_PID" 2>/dev/null; BENCH_PID=""
  local errors
  errors=$(awk '/^client errors/ { print $NF }' "$OUT/idle-$round-$name.txt")
  stop
  awk -v round="$round" -v name="$name" -v r0="$r0" -v r1="$r1" -v u="$((u1 - u0))" -v s="$((s1 - s0))" \
      -v hz="$TICKS" -v t0="$t0" -v t1="$t1" -v sc="$syscalls" -v err="${errors:-?}" 'BEGIN {
    n = r1 - r0; if (n <= 0) { print "round " round " " name ": no requests answered" > "/dev/stderr"; exit 1 }
    us = u / hz * 1e6 / n; ss = s / hz * 1e6 / n
    printf "round %s %-8s %7d requests in %.1f s (%.0f/s), client errors %s: %5.1f µs/request (user %.1f, sys %.1f)%s\n",
      round, name, n, t1 - t0, n / (t1 - t0), err, us + ss, us, ss, (sc != "" ? ", " sc " syscalls/request" : "") > "/dev/stderr"
    printf "%s %s %d %.3f %.3f %s\n", round, name, n, us, ss, sc
  }' >>"$RESULTS"
}

for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="runfeed bare"; else order="bare runfeed"; fi
  [ "${RAW:-0}" = 1 ] && order="$order raw"
  [ -n "${BEFORE_BIN:-}" ] && order="before $order"
  for name in $order; do
    pass "$round" "$name" || exit 1
  done
done

# Per round and over all rounds: µs per request (user / sys) of both, and runfeed / bare.
awk -v strace="$STRACE" '
  { key = $1 SUBSEP $2; us[key] = $4; ss[key] = $5; sc[key] = $6; rounds[$1] = 1
    tu[$2] += $4; ts[$2] += $5; tc[$2] += $6; cnt[$2]++ }
  function row(label, ru, rs, bu, bs, rc, bc) {
    printf "%-7s | %6.1f (%5.1f / %5.1f) | %6.1f (%5.1f / %5.1f) | %5.2f", label, ru + rs, ru, rs, bu + bs, bu, bs, (ru + rs) / (bu + bs)
    if (strace == 1) printf " | %s / %s", rc, bc
    printf "\n"
  }
  END {
    printf "\nserver CPU per answered request, µs: total (user / sys)\n"
    printf "%-7s | %-22s | %-22s | %s%s\n", "round", "runfeed", "bare hyper", "ratio", (strace == 1 ? " | syscalls/request runfeed / bare" : "")
    for (r = 1; (r SUBSEP "runfeed") in us; r++)
      row(r, us[r, "runfeed"], ss[r, "runfeed"], us[r, "bare"], ss[r, "bare"], sc[r, "runfeed"], sc[r, "bare"])
    n = cnt["runfeed"]; m = cnt["bare"]
    if (n > 0 && m > 0)
      row("mean", tu["runfeed"] / n, ts["runfeed"] / n, tu["bare"] / m, ts["bare"] / m,
        sprintf("%.2f", tc["runfeed"] / n), sprintf("%.2f", tc["bare"] / m))
    k = cnt["raw"]
    if (k > 0 && m > 0)
      printf "raw (bare --engine raw, no hyper), mean: %.1f (%.1f / %.1f) µs, %.2f × bare hyper\n",
        (tu["raw"] + ts["raw"]) / k, tu["raw"] / k, ts["raw"] / k, (tu["raw"] + ts["raw"]) / (tu["bare"] + ts["bare"]) * m / k
    k = cnt["before"]
    if (k > 0 && m > 0 && n > 0)
      printf "before (BEFORE_BIN), mean: %.1f (%.1f / %.1f) µs, %.2f × bare hyper; runfeed / before %.2f\n",
        (tu["before"] + ts["before"]) / k, tu["before"] / k, ts["before"] / k,
        (tu["before"] + ts["before"]) / (tu["bare"] + ts["bare"]) * m / k,
        (tu["runfeed"] + ts["runfeed"]) / n / ((tu["before"] + ts["before"]) / k)
  }' "$RESULTS"
