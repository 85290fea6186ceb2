#!/usr/bin/env bash
# A throwaway PostgreSQL 15 primary of its own (trust auth, user postgres) for the fault tests
# and scenarios that stop, restart or starve a database (tests/it/faults_http.rs, runfeed-faults):
# never the shared 127.0.0.1:5432.
#
#   bash scripts/pg-instance.sh start   --port P [--max-connections N]   # prints PG_URL=postgres://postgres@127.0.0.1:P
#   bash scripts/pg-instance.sh stop    --port P      # pg_ctl stop -m fast; the data directory stays
#   bash scripts/pg-instance.sh resume  --port P      # starts a stopped instance again (same data)
#   bash scripts/pg-instance.sh destroy --port P      # stop (immediate) and remove the directory
#
# Data: /tmp/runfeed-pg-<port>/data, log /tmp/runfeed-pg-<port>/pg.log. `start` replaces an
# instance left on the same port. superuser_reserved_connections is 0, so max_connections
# bounds superusers too (the max_connections fault). Every wait is bounded (PG_TIMEOUT s, 30).
set -euo pipefail

BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
TIMEOUT="${PG_TIMEOUT:-30}"
log() { printf '[pg-instance] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

CMD="${1:-}"; [ -n "$CMD" ] || usage; shift
PORT=""; MAXCONN=100
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="${2:?}"; shift 2 ;;
    --max-connections) MAXCONN="${2:?}"; shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ne 5432 ] || die "--port must be a port other than 5432"
DIR="/tmp/runfeed-pg-$PORT"; DATA="$DIR/data"; LOG="$DIR/pg.log"

as_pg() {
  if [ "$(id -un)" = postgres ]; then (cd /tmp && "$@")
  elif [ "$(id -u)" -eq 0 ]; then (cd /tmp && runuser -u postgres -- "$@")
  else (cd /tmp && sudo -n -u postgres -- "$@"); fi
}

wait_ready() {
  for _ in $(seq 1 $((TIMEOUT * 10))); do
    "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" && return 0
    sleep 0.1
  done
  die "no answer on $PORT within ${TIMEOUT}s (log: $LOG)"
}

pg_start() {
  as_pg "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t "$TIMEOUT" start >/dev/null
  wait_ready
}

case "$CMD" in
  start)
    if [ -d "$DATA" ]; then as_pg "$BIN/pg_ctl" -D "$DATA" -m immediate stop >/dev/null 2>&1 || true; fi
    rm -rf "$DIR"; mkdir -p "$DIR"; chown postgres "$DIR" 2>/dev/null || true
    as_pg "$BIN/initdb" -D "$DATA" -U postgres -A trust >/dev/null
    cat >> "$DATA/postgresql.conf" <<CONF
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
max_connections = $MAXCONN
superuser_reserved_connections = 0
fsync = off
synchronous_commit = off
full_page_writes = off
CONF
    pg_start
    echo "PG_URL=postgres://postgres@127.0.0.1:$PORT"
    ;;
  stop) as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w -t "$TIMEOUT" stop >/dev/null ;;
  resume) pg_start ;;
  destroy)
    if [ -d "$DATA" ]; then as_pg "$BIN/pg_ctl" -D "$DATA" -m immediate stop >/dev/null 2>&1 || true; fi
    rm -rf "$DIR" ;;
  *) usage ;;
esac
