#!/usr/bin/env bash
# Compose `postgres` service, run once by the official image's entrypoint when it initialises
# an empty data directory (mounted into /docker-entrypoint-initdb.d; sourced or executed, so no
# `set` here): let the streaming replica (`postgres-replica`, pg_basebackup) connect for
# replication from the compose network. POSTGRES_HOST_AUTH_METHOD=trust only adds
# `host all all all trust`, and `all` does not match replication connections.
# Development only: no password.
echo "host replication all all trust" >> "$PGDATA/pg_hba.conf"
