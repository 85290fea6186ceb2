#!/usr/bin/env bash
# A real streaming read replica of the local PostgreSQL (127.0.0.1:5432), for the replica tests
# (tests/it/replica.rs) and for trying runfeed against a lagging replica by hand.
#
#   bash scripts/replica.sh start  [--delay-ms N] [--port P] [--primary-port Q]   # prints REPLICA_URL=postgres://postgres@127.0.0.1:P/postgres
#   bash scripts/replica.sh status [--port P]                  # exit 0 running, 3 not running
#   bash scripts/replica.sh restart [--port P] [--down-ms MS]  # pg_ctl stop -m fast, MS later start again
#   bash scripts/replica.sh promote [--port P]                 # pg_ctl promote: the replica becomes a primary
#   bash scripts/replica.sh stop   [--port P]
#
# --primary-port Q replicates another local PostgreSQL on 127.0.0.1:Q (default 5432, e.g. an own
# instance of scripts/pg-instance.sh); the other commands read it back from the replica's directory.
# restart: waits until the replica is streaming again. promote: waits until it left recovery.
# start: lets the local cluster accept replication connections (appends `host replication all
# 127.0.0.1/32 trust` / `local replication all trust` to its pg_hba.conf when missing, reloads),
# takes a pg_basebackup (as the postgres user) into /tmp/runfeed-replica-<port>/data, configures a
# hot standby on 127.0.0.1:<port> with recovery_min_apply_delay = N ms (default 300; every commit
# becomes visible on the replica N ms after its commit time on the primary), starts it with
# pg_ctl as postgres (log: /tmp/runfeed-replica-<port>/replica.log) and waits until it accepts
# connections, is in recovery and streams from the primary. A replica left on the same port by an
# earlier run is stopped and replaced first, so `start` is idempotent.
# stop: pg_ctl stop -m fast (immediate if that does not finish), then removes the directory.
#
# Every wait is bounded by REPLICA_TIMEOUT seconds (default 30), the base backup by that plus one
# second per 50 MB of the primary's databases. Databases created on the primary
# later appear on the replica after the apply delay.
set -euo pipefail

PRIMARY_HOST=127.0.0.1
PRIMARY_PORT=5432
TIMEOUT="${REPLICA_TIMEOUT:-30}"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] && [ "$TIMEOUT" -ge 5 ] || TIMEOUT=5

log() { printf '[replica] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

CMD="${1:-}"
[ -n "$CMD" ] || usage
shift
DELAY_MS=300
PORT=5433
DOWN_MS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --delay-ms) DELAY_MS="${2:?--delay-ms needs a value}"; shift 2 ;;
    --delay-ms=*) DELAY_MS="${1#*=}"; shift ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --port=*) PORT="${1#*=}"; shift ;;
    --primary-port) PRIMARY_PORT="${2:?--primary-port needs a value}"; PRIMARY_SET=1; shift 2 ;;
    --primary-port=*) PRIMARY_PORT="${1#*=}"; PRIMARY_SET=1; shift ;;
    --down-ms) DOWN_MS="${2:?--down-ms needs a value}"; shift 2 ;;
    --down-ms=*) DOWN_MS="${1#*=}"; shift ;;
    -h|--help) usage ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ "$DELAY_MS" =~ ^[0-9]+$ ]] || die "--delay-ms must be a number of milliseconds"
[[ "$DOWN_MS" =~ ^[0-9]+$ ]] || die "--down-ms must be a number of milliseconds"
[[ "$PRIMARY_PORT" =~ ^[0-9]+$ ]] || die "--primary-port must be a port number"
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || [ "$PORT" -eq "$PRIMARY_PORT" ]; then
  die "--port must be a port other than $PRIMARY_PORT"
fi

DIR="/tmp/runfeed-replica-$PORT"
DATA="$DIR/data"
LOGFILE="$DIR/replica.log"
if [ -z "${PRIMARY_SET:-}" ] && [ "$CMD" != start ] && [ -f "$DIR/primary-port" ]; then
  PRIMARY_PORT=$(cat "$DIR/primary-port")
fi
URL="postgres://postgres@127.0.0.1:$PORT/postgres"

# Run a command as the postgres user (from a directory it can read).
as_postgres() {
  if [ "$(id -un)" = postgres ]; then (cd /tmp && "$@")
  elif [ "$(id -u)" -eq 0 ]; then (cd /tmp && runuser -u postgres -- "$@")
  else (cd /tmp && sudo -n -u postgres -- "$@")
  fi
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

primary_sql() { psql -h "$PRIMARY_HOST" -p "$PRIMARY_PORT" -U postgres -d postgres -XAtq -v ON_ERROR_STOP=1 -c "$1"; }
replica_sql() { psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -XAtq -v ON_ERROR_STOP=1 -c "$1" 2>/dev/null; }

# Polls `probe` (a command) every 0.1 s until it succeeds; dies after TIMEOUT seconds.
wait_for() { # what, command...
  local what=$1; shift
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      [ -f "$LOGFILE" ] && { log "last lines of $LOGFILE:"; tail -n 20 "$LOGFILE" >&2; }
      die "$what: not within ${TIMEOUT}s"
    fi
    sleep 0.1
  done
}

bin_dir() {
  local major
  major=$(primary_sql "SELECT current_setting('server_version_num')::int / 10000") \
    || die "the local PostgreSQL on $PRIMARY_HOST:$PRIMARY_PORT does not answer (bash scripts/services.sh)"
  local dir="/usr/lib/postgresql/$major/bin"
  [ -x "$dir/pg_ctl" ] || die "no $dir/pg_ctl (PostgreSQL $major server binaries)"
  echo "$dir"
}

# The replica's postmaster pid: from postmaster.pid, or (while it is still starting) the
# postgres process serving exactly this data directory.
postmaster_pid() {
  local pid=""
  [ -f "$DATA/postmaster.pid" ] && pid=$(head -n 1 "$DATA/postmaster.pid" 2>/dev/null)
  [ -n "$pid" ] || pid=$(pgrep -o -x -f "[^ ]*postgres -D $DATA" 2>/dev/null || true)
  echo "$pid"
}

pid_running() { local pid; pid=$(postmaster_pid); [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

stop_replica() {
  if pid_running; then
    local bin
    bin=$(bin_dir)
    log "stopping the replica on port $PORT"
    if ! as_postgres timeout $((TIMEOUT + 5)) "$bin/pg_ctl" -D "$DATA" -m fast -w -t "$TIMEOUT" stop >/dev/null 2>&1; then
      log "fast shutdown did not finish; immediate shutdown"
      as_postgres timeout 15 "$bin/pg_ctl" -D "$DATA" -m immediate -w -t 10 stop >/dev/null 2>&1 || true
    fi
    if pid_running; then
      local pid
      pid=$(postmaster_pid)
      log "the replica postmaster $pid is still running; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      local deadline=$((SECONDS + 10))
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    fi
  fi
  if [ -d "$DIR" ]; then
    rm -rf "$DIR"
  fi
}

# The local cluster must accept replication connections over TCP from 127.0.0.1 (pg_basebackup,
# the standby's walreceiver).
ensure_replication_allowed() {
  local hba changed=0
  hba=$(primary_sql "SHOW hba_file") || die "cannot read hba_file from the primary"
  [ -f "$hba" ] || die "pg_hba.conf $hba not found"
  if ! grep -Eq '^[[:space:]]*host(ssl|nossl)?[[:space:]]+replication[[:space:]]+[^[:space:]]+[[:space:]]+(127\.0\.0\.1(/32)?|all|0\.0\.0\.0/0|samehost)[[:space:]]' "$hba"; then
    log "allowing replication connections from 127.0.0.1 in $hba"
    printf '\n# runfeed scripts/replica.sh: streaming replica for tests\nhost replication all 127.0.0.1/32 trust\n' | as_root tee -a "$hba" >/dev/null
    changed=1
  fi
  if ! grep -Eq '^[[:space:]]*local[[:space:]]+replication[[:space:]]' "$hba"; then
    log "allowing local replication connections in $hba"
    printf 'local replication all trust\n' | as_root tee -a "$hba" >/dev/null
    changed=1
  fi
  if [ "$changed" -eq 1 ]; then
    primary_sql "SELECT pg_reload_conf()" >/dev/null || die "pg_reload_conf() failed"
  fi
  # The reload is asynchronous: wait until a replication connection is actually accepted.
  wait_for "a replication connection to the primary" \
    psql "host=$PRIMARY_HOST port=$PRIMARY_PORT user=postgres dbname=postgres replication=true" -XAtq -c "IDENTIFY_SYSTEM"
}

start_replica() {
  local bin
  bin=$(bin_dir)
  if [ -d "$DIR" ] || pid_running; then
    log "a replica from an earlier run is on port $PORT; replacing it"
    stop_replica
  fi
  if port_open; then
    die "port $PORT is in use by something other than a replica of this script"
  fi
  ensure_replication_allowed

  local t0=$SECONDS
  mkdir -p "$DIR"
  chown postgres:postgres "$DIR" 2>/dev/null || as_root chown postgres:postgres "$DIR"
  chmod 700 "$DIR"
  echo "$PRIMARY_PORT" >"$DIR/primary-port"
  # The copy's time grows with the primary's size (a generated benchmark database can be tens of
  # GB): its bound is TIMEOUT plus one second per 50 MB.
  local bytes copy_timeout
  bytes=$(primary_sql "SELECT sum(pg_database_size(datname))::bigint FROM pg_database") || bytes=0
  copy_timeout=$((TIMEOUT + bytes / 50000000))
  log "pg_basebackup of $PRIMARY_HOST:$PRIMARY_PORT ($((bytes / 1000000)) MB) into $DATA (bound ${copy_timeout}s)"
  if ! as_postgres timeout "$copy_timeout" "$bin/pg_basebackup" -h "$PRIMARY_HOST" -p "$PRIMARY_PORT" -U postgres -w \
      -D "$DATA" -R -X stream -c fast --no-sync >"$DIR/basebackup.log" 2>&1; then
    cat "$DIR/basebackup.log" >&2 || true
    rm -rf "$DIR"
    die "pg_basebackup failed or took longer than ${copy_timeout}s"
  fi

  # A hot standby needs these at least as large as on the primary.
  local max_conn max_workers max_prepared max_locks max_senders
  max_conn=$(primary_sql "SHOW max_connections")
  max_workers=$(primary_sql "SHOW max_worker_processes")
  max_prepared=$(primary_sql "SHOW max_prepared_transactions")
  max_locks=$(primary_sql "SHOW max_locks_per_transaction")
  max_senders=$(primary_sql "SHOW max_wal_senders")
  # Debian keeps the cluster's configuration under /etc, so the copy has none of its own.
  as_postgres tee "$DATA/postgresql.conf" >/dev/null <<EOF
# Written by runfeed scripts/replica.sh (a throwaway test replica).
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
hot_standby = on
recovery_min_apply_delay = '${DELAY_MS}ms'
max_standby_streaming_delay = 5s
max_connections = $max_conn
max_worker_processes = $max_workers
max_prepared_transactions = $max_prepared
max_locks_per_transaction = $max_locks
max_wal_senders = $max_senders
shared_buffers = 32MB
fsync = off
synchronous_commit = off
full_page_writes = off
log_line_prefix = '%m [%p] '
log_min_messages = warning
EOF
  as_postgres tee "$DATA/pg_hba.conf" >/dev/null <<EOF
local all all trust
host all all 127.0.0.1/32 trust
local replication all trust
host replication all 127.0.0.1/32 trust
EOF
  as_postgres tee "$DATA/pg_ident.conf" >/dev/null </dev/null

  log "starting the replica on 127.0.0.1:$PORT (recovery_min_apply_delay ${DELAY_MS} ms)"
  # Never leave a half-started replica behind.
  READY=0
  trap 'if [ "$READY" != 1 ]; then log "start failed; removing the replica"; stop_replica; fi' EXIT
  if ! as_postgres timeout $((TIMEOUT + 5)) "$bin/pg_ctl" -D "$DATA" -l "$LOGFILE" -w -t "$TIMEOUT" start >/dev/null 9>&-; then
    tail -n 30 "$LOGFILE" >&2 || true
    die "the replica did not start"
  fi
  wait_for "the replica in recovery" test_in_recovery
  wait_for "the replica streaming from the primary" test_streaming
  READY=1
  log "replica ready in $((SECONDS - t0))s"
  echo "REPLICA_URL=$URL"
}

test_in_recovery() { [ "$(replica_sql "SELECT pg_is_in_recovery()")" = t ]; }
test_streaming() { [ "$(replica_sql "SELECT status FROM pg_stat_wal_receiver")" = streaming ]; }

restart_replica() {
  local bin t0=$SECONDS
  bin=$(bin_dir)
  pid_running || die "no replica on port $PORT (start it first)"
  log "stopping the replica on port $PORT (pg_ctl stop -m fast)"
  as_postgres timeout $((TIMEOUT + 5)) "$bin/pg_ctl" -D "$DATA" -m fast -w -t "$TIMEOUT" stop >/dev/null \
    || die "the replica did not stop"
  if [ "$DOWN_MS" -gt 0 ]; then
    sleep "$(awk -v ms="$DOWN_MS" 'BEGIN { printf "%.3f", ms / 1000 }')"
  fi
  log "starting the replica on port $PORT again"
  as_postgres timeout $((TIMEOUT + 5)) "$bin/pg_ctl" -D "$DATA" -l "$LOGFILE" -w -t "$TIMEOUT" start >/dev/null 9>&- \
    || die "the replica did not start again"
  wait_for "the replica in recovery" test_in_recovery
  wait_for "the replica streaming from the primary" test_streaming
  log "replica back in $((SECONDS - t0))s"
}

promote_replica() {
  local bin t0=$SECONDS
  bin=$(bin_dir)
  pid_running || die "no replica on port $PORT (start it first)"
  log "promoting the replica on port $PORT (pg_ctl promote)"
  as_postgres timeout $((TIMEOUT + 5)) "$bin/pg_ctl" -D "$DATA" -w -t "$TIMEOUT" promote >/dev/null \
    || die "pg_ctl promote failed"
  wait_for "the replica out of recovery" test_promoted
  log "promoted in $((SECONDS - t0))s"
}

test_promoted() { [ "$(replica_sql "SELECT pg_is_in_recovery()")" = f ]; }

status_replica() {
  if pid_running && test_in_recovery; then
    echo "REPLICA_URL=$URL"
    replica_sql "SELECT 'recovery_min_apply_delay=' || current_setting('recovery_min_apply_delay')
      || ' receiver=' || coalesce((SELECT status FROM pg_stat_wal_receiver), 'none')
      || ' replay_paused=' || pg_is_wal_replay_paused()
      || ' last_replayed_commit_age=' || coalesce((now() - pg_last_xact_replay_timestamp())::text, 'n/a')"
    return 0
  fi
  echo "not running (port $PORT)"
  return 3
}

# One start/stop per port at a time (the server is started with the lock descriptor closed).
lock() {
  exec 9>"/tmp/runfeed-replica-$PORT.lock"
  flock -w "$TIMEOUT" 9 || die "another scripts/replica.sh holds /tmp/runfeed-replica-$PORT.lock"
}

case "$CMD" in
  start) lock; start_replica ;;
  stop) lock; stop_replica; log "stopped (port $PORT)" ;;
  status) status_replica ;;
  restart) lock; restart_replica ;;
  promote) lock; promote_replica ;;
  *) usage ;;
esac
