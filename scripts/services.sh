#!/usr/bin/env bash
# Ensures the local services runfeed needs are up, idempotently:
#   PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth) and Redis on 127.0.0.1:6379.
# Starts a stopped service with the same command the machine image uses; installs the Debian
# package only when its binaries are missing (one `apt-get update`, then install).
# Waits until each answers (pg_isready / PING), at most SERVICES_TIMEOUT seconds (default 60).
set -euo pipefail

PG_HOST=127.0.0.1
PG_PORT=5432
REDIS_HOST=127.0.0.1
REDIS_PORT="${SERVICES_REDIS_PORT:-6379}"   # override only to test this script
TIMEOUT="${SERVICES_TIMEOUT:-60}"

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else "$@"
  fi
}

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install $* yourself"
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt-get update"
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  log "apt-get install $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# A TCP connect probe that needs nothing but bash.
tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

pg_ready() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -h "$PG_HOST" -p "$PG_PORT" -q
  else
    tcp_open "$PG_HOST" "$PG_PORT"
  fi
}

redis_ready() {
  if command -v redis-cli >/dev/null 2>&1; then
    [ "$(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
  else
    local reply
    reply=$( { exec 3<>"/dev/tcp/$REDIS_HOST/$REDIS_PORT" && printf 'PING\r\n' >&3 && head -c 5 <&3; } 2>/dev/null ) || return 1
    [ "$reply" = "+PONG" ]
  fi
}

wait_until() { # name, probe function
  local name=$1 probe=$2 deadline=$((SECONDS + TIMEOUT))
  until "$probe"; do
    [ "$SECONDS" -lt "$deadline" ] || die "$name not ready after ${TIMEOUT}s"
    sleep 0.5
  done
  log "$name is up"
}

pg_version() { find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -V | tail -n 1; }

ensure_postgres() {
  if pg_ready; then log "postgres already up on $PG_HOST:$PG_PORT"; return; fi
  local installed_now=0
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(pg_version)" ]; then
    apt_install postgresql
    installed_now=1
  fi
  local version
  version=$(pg_version)
  [ -n "$version" ] || die "no PostgreSQL cluster under /etc/postgresql"
  if [ "$installed_now" -eq 1 ]; then
    # A freshly installed cluster asks for passwords over TCP; the project (like the CI machine)
    # connects as postgres without one on loopback.
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    if [ -f "$hba" ]; then
      as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
    fi
  fi
  log "starting postgres $version/main"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || pg_ready || true
  wait_until postgres pg_ready
}

ensure_redis() {
  if redis_ready; then log "redis already up on $REDIS_HOST:$REDIS_PORT"; return; fi
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
    # The package's own service may already have started it.
    if redis_ready; then log "redis is up"; return; fi
  fi
  as_root mkdir -p /var/lib/redis /var/log/redis
  log "starting redis-server"
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" \
    --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_until redis redis_ready
}

ensure_postgres
ensure_redis
