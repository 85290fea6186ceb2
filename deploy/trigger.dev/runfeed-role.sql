-- runfeed's database role: SELECT on exactly the tables and columns `runfeed serve` reads from
-- trigger.dev's database, and nothing else. runfeed never writes to Postgres.
--
-- The list is src/store/grants.rs (`required()`); tests/it/grants.rs fails when this file and that
-- list disagree, and runs runfeed as this role. runfeed checks the grants itself at start and on
-- /readyz (check "grants"), naming any privilege that is missing.
--
-- Run it with psql as the owner of trigger.dev's tables (the `postgres` user of trigger.dev's
-- Docker Compose and Helm set-ups), in trigger.dev's database, on the PRIMARY:
--
--   psql "postgresql://postgres:…@postgres:5432/main" -v ON_ERROR_STOP=1 \
--        -v runfeed_password="$RUNFEED_DB_PASSWORD" -f runfeed-role.sql
--
-- psql variables: `role` (default runfeed), `schema` (default public: trigger.dev's tables),
-- `runfeed_password` (optional; sets the role's password). Idempotent: run it again after an
-- upgrade of runfeed; it first revokes every table privilege the role had in the schema.
--
-- A streaming (physical) replica replays these grants, so DATABASE_READ_REPLICA_URL can use the
-- same role; a logical replica or a separately restored copy needs this file run there too.
-- Then point runfeed at the database as this role:
--   DATABASE_URL=postgresql://runfeed:…@postgres:5432/main?sslmode=…

\set ON_ERROR_STOP on
\if :{?role}
\else
  \set role runfeed
\endif
\if :{?schema}
\else
  \set schema public
\endif

-- The role: login only (CREATE ROLE's defaults: no superuser, no CREATEDB/CREATEROLE, no
-- replication, no RLS bypass), and read-only transactions by default.
SELECT format('CREATE ROLE %I LOGIN', :'role')
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = :'role') \gexec
ALTER ROLE :"role" SET default_transaction_read_only = on;
\if :{?runfeed_password}
ALTER ROLE :"role" PASSWORD :'runfeed_password';
\endif

SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'role') \gexec
GRANT USAGE ON SCHEMA :"schema" TO :"role";

-- Start from nothing: no table or column privilege in the schema (also revokes anything a
-- previous version of this file granted that runfeed no longer reads).
REVOKE ALL ON ALL TABLES IN SCHEMA :"schema" FROM :"role";

-- Runs: the 26 columns of the feed (trigger.dev's RUN_ELECTRIC_COLUMNS, wire order), the batch
-- membership and the environment every read is scoped to.
GRANT SELECT (
    id, "taskIdentifier", "createdAt", "updatedAt", "startedAt", "delayUntil", "queuedAt",
    "expiredAt", "completedAt", "friendlyId", number, "isTest", status, "usageDurationMs",
    "costInCents", "baseCostInCents", ttl, payload, "payloadType", metadata, "metadataType",
    output, "outputType", "runTags", error, "realtimeStreams",
    "batchId", "runtimeEnvironmentId"
) ON :"schema"."TaskRun" TO :"role";

-- Batches: /realtime/v1/batches/:batchId and a run's batch (scope checks).
GRANT SELECT (id, "friendlyId", "runtimeEnvironmentId") ON :"schema"."BatchTaskRun" TO :"role";

-- Authentication: secret keys, public access tokens (signed with the environment's or, for
-- preview branches, the parent's key), branches, archived environments.
GRANT SELECT (
    id, type, "organizationId", "projectId", "apiKey", "parentEnvironmentId", "branchName",
    "archivedAt"
) ON :"schema"."RuntimeEnvironment" TO :"role";

-- Deleted projects do not authenticate.
GRANT SELECT (id, "deletedAt") ON :"schema"."Project" TO :"role";

-- Revoked secret keys keep working until "expiresAt" (trigger.dev's rotation grace period).
GRANT SELECT ("apiKey", "runtimeEnvironmentId", "expiresAt") ON :"schema"."RevokedApiKey" TO :"role";

-- The read-your-writes gate's WAL-position probes: PUBLIC may run these by default; grant them
-- explicitly in case the database revoked that.
GRANT EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn() TO :"role";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_last_wal_replay_lsn() TO :"role";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery() TO :"role";
