#!/usr/bin/env bash
# Feeds at production data volume: `runfeed-bench gen` fills `runfeed_volume_<RUNS>` (once: an
# existing, complete database is reused), then for each server configuration a release
# `runfeed serve` is started against it with Redis, `runfeed-bench volume` runs (cold stampede of
# K tag filters with the fairness probe, idle long-polls, optional churn, the set queries' plans)
# and the server is stopped. Tables on stdout, JSON under $BENCH_OUT.
#   bash scripts/bench-volume.sh
#   RUNS=20000 K=20 IDLE_S=5 bash scripts/bench-volume.sh
#   EXTRA='RUNFEED_CACHES__BACKSTOP_SHARE_MS=0 | ' bash scripts/bench-volume.sh   # two configurations
# Env: RUNS (2500000), DAYS (2), ENVS (5), SEED (1), K (1000), IDLE_S (150), CHURN_PER_SEC (0),
# EXPLAIN (1: the plans after the phases), EXTRA (server environment, `VAR=value …`; several
# configurations separated by `|`, each measured on a fresh server of the same binary, in order),
# VOLUME_ARGS (more `runfeed-bench volume` arguments, e.g. `--probes 40 --probe-interval-ms 250`),
# NO_BUILD (1: do not build), RUNFEED_BIN (target/release/runfeed), BENCH (target/release/runfeed-bench),
# BENCH_OUT (target/bench-volume), DB (runfeed_volume_<RUNS>), PG_ADMIN, REDIS_URL, SERVER_LOG
# (runfeed's RUST_LOG, default info).
# The data stays for the next run; drop it with `psql -c 'DROP DATABASE runfeed_volume_<RUNS>'`,
# and do before `scripts/test.sh`: its replica step copies the whole local Postgres (pg_basebackup).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
RUNFEED_BIN="${RUNFEED_BIN:-$TARGET_DIR/release/runfeed}"
BENCH="${BENCH:-$TARGET_DIR/release/runfeed-bench}"
RUNS="${RUNS:-2500000}"
DAYS="${DAYS:-2}"
ENVS="${ENVS:-5}"
SEED="${SEED:-1}"
K="${K:-1000}"
IDLE_S="${IDLE_S:-150}"
CHURN_PER_SEC="${CHURN_PER_SEC:-0}"
EXPLAIN="${EXPLAIN:-1}"
EXTRA="${EXTRA:-}"
PG_ADMIN="${PG_ADMIN:-postgres://postgres@127.0.0.1:5432}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
OUT="${BENCH_OUT:-$TARGET_DIR/bench-volume}"
DB="${DB:-runfeed_volume_$RUNS}"
DB_URL="$PG_ADMIN/$DB"
mkdir -p "$OUT"
log() { printf '[bench-volume] %s\n' "$*" >&2; }

# K feeds, each a socket on both sides, plus the stampede's: raise the soft fd limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 65536 2>/dev/null || true
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((2 * K + 1000)) ]; then
  log "ulimit -n is $(ulimit -n) (hard $(ulimit -Hn)): too low for K=$K"
  exit 1
fi
if [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --locked --release --bin runfeed --bin runfeed-bench || exit 1
fi
[ -x "$RUNFEED_BIN" ] || { log "no $RUNFEED_BIN"; exit 1; }
[ -x "$BENCH" ] || { log "no $BENCH"; exit 1; }

# The data: generated once, kept. A database without gen's comment on "TaskRun" is an
# interrupted generation: dropped and written again.
psql_q() { psql "$1" -XAtqc "$2" 2>/dev/null; }
if [ "$(psql_q "$PG_ADMIN/postgres" "SELECT 1 FROM pg_database WHERE datname = '$DB'")" = 1 ]; then
  if [ -z "$(psql_q "$DB_URL" "SELECT obj_description('\"TaskRun\"'::regclass, 'pg_class')")" ]; then
    log "$DB is incomplete: dropping it"
    psql "$PG_ADMIN/postgres" -Xqc "DROP DATABASE \"$DB\" WITH (FORCE)" || exit 1
  else
    log "reusing $DB: $(psql_q "$DB_URL" "SELECT obj_description('\"TaskRun\"'::regclass, 'pg_class')")"
  fi
fi
if [ "$(psql_q "$PG_ADMIN/postgres" "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
  log "generating $DB: $RUNS runs over $DAYS days, $ENVS environments, seed $SEED"
  nice -n 10 "$BENCH" gen --database-url "$DB_URL" --runs "$RUNS" --days "$DAYS" --envs "$ENVS" \
    --seed "$SEED" --json "$OUT/gen.json" || { log "gen failed"; exit 1; }
fi

PID=""
stop() {
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=""; fi
}
trap stop EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# pass N CONFIG: a fresh server with the environment CONFIG (`VAR=value …`), the volume scenario.
pass() {
  local n=$1 config=$2 admin_port logf base=""
  admin_port=$(free_port)
  logf="$OUT/server-$n.log"
  : >"$logf"
  log "pass $n: server environment: ${config:-(defaults)}"
  # The feeds' window is 24 h of data as generated (`volume --window auto`): a day older data
  # needs a longer createdAt than the default clamp of 24 h allows. A config may override it.
  # shellcheck disable=SC2086
  env RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$admin_port" RUNFEED_SERVER__HANDLE_SECRET=bench-volume-secret \
    RUNFEED_FEEDS__MAXIMUM_CREATED_AT_FILTER_AGE_MS=$((30 * 86400000)) RUST_LOG="${SERVER_LOG:-info}" $config \
    "$RUNFEED_BIN" serve --listen 127.0.0.1:0 --database-url "$DB_URL" --redis-url "$REDIS_URL" >"$logf" 2>&1 &
  PID=$!
  for _ in $(seq 1 400); do
    base=$(sed -n 's/^runfeed listening on //p' "$logf" | head -n1)
    [ -n "$base" ] && break
    kill -0 "$PID" 2>/dev/null || { log "server exited"; cat "$logf" >&2; PID=""; return 1; }
    sleep 0.05
  done
  [ -n "$base" ] || { log "server never listened"; stop; return 1; }
  local extra=()
  [ "$EXPLAIN" = 1 ] && extra+=(--explain)
  # shellcheck disable=SC2206
  extra+=(${VOLUME_ARGS:-})
  "$BENCH" volume --base-url "$base" --database-url "$DB_URL" --redis-url "$REDIS_URL" \
    --admin-url "http://127.0.0.1:$admin_port" --server-pid "$PID" --server-log "$logf" \
    --k "$K" --idle-s "$IDLE_S" --churn-per-sec "$CHURN_PER_SEC" --json "$OUT/volume-$n.json" "${extra[@]}"
  local rc=$?
  stop
  return $rc
}

FAILED=0
n=0
IFS='|' read -r -a CONFIGS <<<"$EXTRA"
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=("")
# A trailing `|` is one more configuration: the defaults.
[[ "$EXTRA" == *"|" ]] && CONFIGS+=("")
for config in "${CONFIGS[@]}"; do
  n=$((n + 1))
  pass "$n" "$(echo "$config" | xargs)" || { log "pass $n FAILED"; FAILED=1; }
done
[ "$FAILED" -eq 0 ] && log "OK (JSON in $OUT)"
exit "$FAILED"
