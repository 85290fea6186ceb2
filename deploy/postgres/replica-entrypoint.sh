#!/usr/bin/env bash
# Compose `postgres-replica` service (runs as the postgres user): on first start, clone the
# primary with pg_basebackup (-R writes primary_conninfo and standby.signal, -X stream carries
# the WAL written meanwhile), then run the server command given as arguments: a hot standby
# that streams from the primary. The primary must allow replication connections
# (deploy/postgres/primary-init.sh) and run with wal_level replica or logical.
set -euo pipefail
PGDATA="${PGDATA:-/var/lib/postgresql/data}"
PRIMARY_HOST="${PRIMARY_HOST:-postgres}"
PRIMARY_USER="${PRIMARY_USER:-postgres}"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  # The image's data directory is 1777; postgres refuses anything wider than 0750.
  chmod 0700 "$PGDATA"
  # Only the primary's real server listens on TCP (its init-time server does not).
  until pg_isready -q -h "$PRIMARY_HOST" -U "$PRIMARY_USER"; do
    echo "replica: waiting for $PRIMARY_HOST" >&2
    sleep 1
  done
  echo "replica: pg_basebackup from $PRIMARY_HOST into $PGDATA" >&2
  pg_basebackup -h "$PRIMARY_HOST" -U "$PRIMARY_USER" -D "$PGDATA" -R -X stream -c fast
fi
chmod 0700 "$PGDATA"
exec "$@"
