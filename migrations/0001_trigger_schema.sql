-- The subset of trigger.dev's Postgres schema that runfeed reads (trigger-facts §1).
--
-- Names, types, nullability and defaults mirror the database produced by applying trigger.dev's
-- Prisma migrations (internal-packages/database/prisma/migrations): quoted camelCase tables and
-- columns, `timestamp(3) without time zone` holding UTC, Prisma enums as Postgres enum types,
-- no database default for `id` / `updatedAt` (Prisma fills them client-side). A fixture that sets
-- only the NOT NULL-without-default columns therefore works both here and against a real
-- trigger.dev database.
--
-- Every statement tolerates pre-existing objects (CREATE ... IF NOT EXISTS, enum creation guarded
-- by duplicate_object), so applying this to a database that already holds trigger.dev's tables
-- leaves them untouched. Only indexes whose names were verified against a migrated trigger.dev
-- database (or that follow Prisma's naming for a unique/foreign key) are created, so that running
-- this against a real database never builds a second, differently named index on a big table.

-- ---------------------------------------------------------------------------------------------
-- Enum types (values in pg_enum order, trigger-facts §1.2)
-- ---------------------------------------------------------------------------------------------

DO $$ BEGIN
    CREATE TYPE "TaskRunStatus" AS ENUM (
        'PENDING', 'EXECUTING', 'WAITING_TO_RESUME', 'RETRYING_AFTER_FAILURE', 'PAUSED',
        'CANCELED', 'COMPLETED_SUCCESSFULLY', 'COMPLETED_WITH_ERRORS', 'INTERRUPTED',
        'SYSTEM_FAILURE', 'CRASHED', 'WAITING_FOR_DEPLOY', 'DELAYED', 'EXPIRED', 'TIMED_OUT',
        'PENDING_VERSION', 'DEQUEUED'
    );
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "RuntimeEnvironmentType" AS ENUM ('PRODUCTION', 'STAGING', 'DEVELOPMENT', 'PREVIEW');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "BatchTaskRunStatus" AS ENUM ('PENDING', 'COMPLETED', 'ABORTED', 'PROCESSING', 'PARTIAL_FAILED');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "RunEngineVersion" AS ENUM ('V1', 'V2');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "ProjectVersion" AS ENUM ('V2', 'V3');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "EnvironmentPauseSource" AS ENUM ('BILLING_LIMIT');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$ BEGIN
    CREATE TYPE "OrgMemberRole" AS ENUM ('ADMIN', 'MEMBER');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

-- ---------------------------------------------------------------------------------------------
-- "User", "Organization", "OrgMember", "Project" (trigger-facts §1.9)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "User" (
    "id"                    text NOT NULL,
    "email"                 text NOT NULL,
    "displayName"           text,
    "name"                  text,
    "avatarUrl"             text,
    "admin"                 boolean NOT NULL DEFAULT false,
    "createdAt"             timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"             timestamp(3) without time zone NOT NULL,
    "confirmedBasicDetails" boolean NOT NULL DEFAULT false,
    CONSTRAINT "User_pkey" PRIMARY KEY ("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "User_email_key" ON "User" ("email");

CREATE TABLE IF NOT EXISTS "Organization" (
    "id"                             text NOT NULL,
    "slug"                           text NOT NULL,
    "title"                          text NOT NULL,
    "maximumExecutionTimePerRunInMs" integer NOT NULL DEFAULT 900000,
    "maximumConcurrencyLimit"        integer NOT NULL DEFAULT 10,
    "createdAt"                      timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"                      timestamp(3) without time zone NOT NULL,
    "deletedAt"                      timestamp(3) without time zone,
    "runsEnabled"                    boolean NOT NULL DEFAULT true,
    "v3Enabled"                      boolean NOT NULL DEFAULT false,
    "apiRateLimiterConfig"           jsonb,
    "realtimeRateLimiterConfig"      jsonb,
    "featureFlags"                   jsonb,
    CONSTRAINT "Organization_pkey" PRIMARY KEY ("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "Organization_slug_key" ON "Organization" ("slug");

CREATE TABLE IF NOT EXISTS "OrgMember" (
    "id"             text NOT NULL,
    "organizationId" text NOT NULL,
    "userId"         text NOT NULL,
    "role"           "OrgMemberRole" NOT NULL DEFAULT 'MEMBER',
    "createdAt"      timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"      timestamp(3) without time zone NOT NULL,
    CONSTRAINT "OrgMember_pkey" PRIMARY KEY ("id"),
    CONSTRAINT "OrgMember_organizationId_fkey" FOREIGN KEY ("organizationId")
        REFERENCES "Organization" ("id") ON DELETE CASCADE ON UPDATE CASCADE,
    CONSTRAINT "OrgMember_userId_fkey" FOREIGN KEY ("userId")
        REFERENCES "User" ("id") ON DELETE CASCADE ON UPDATE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "OrgMember_organizationId_userId_key" ON "OrgMember" ("organizationId", "userId");

CREATE TABLE IF NOT EXISTS "Project" (
    "id"                  text NOT NULL,
    "slug"                text NOT NULL,
    "name"                text NOT NULL,
    "externalRef"         text NOT NULL,
    "organizationId"      text NOT NULL,
    "createdAt"           timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"           timestamp(3) without time zone NOT NULL,
    "deletedAt"           timestamp(3) without time zone,
    "version"             "ProjectVersion" NOT NULL DEFAULT 'V2',
    "builderProjectId"    text,
    "allowedMasterQueues" text[] DEFAULT ARRAY[]::text[],
    CONSTRAINT "Project_pkey" PRIMARY KEY ("id"),
    CONSTRAINT "Project_organizationId_fkey" FOREIGN KEY ("organizationId")
        REFERENCES "Organization" ("id") ON DELETE CASCADE ON UPDATE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "Project_slug_key" ON "Project" ("slug");
CREATE UNIQUE INDEX IF NOT EXISTS "Project_externalRef_key" ON "Project" ("externalRef");

-- ---------------------------------------------------------------------------------------------
-- "RuntimeEnvironment" (trigger-facts §1.5)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "RuntimeEnvironment" (
    "id"                          text NOT NULL,
    "slug"                        text NOT NULL,
    "apiKey"                      text NOT NULL,
    "pkApiKey"                    text NOT NULL,
    "type"                        "RuntimeEnvironmentType" NOT NULL DEFAULT 'DEVELOPMENT',
    "shortcode"                   text NOT NULL,
    "maximumConcurrencyLimit"     integer NOT NULL DEFAULT 5,
    "concurrencyLimitBurstFactor" numeric(4, 2) NOT NULL DEFAULT 2.00,
    "paused"                      boolean NOT NULL DEFAULT false,
    "pauseSource"                 "EnvironmentPauseSource",
    "autoEnableInternalSources"   boolean NOT NULL DEFAULT true,
    "organizationId"              text NOT NULL,
    "projectId"                   text NOT NULL,
    "orgMemberId"                 text,
    "createdAt"                   timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"                   timestamp(3) without time zone NOT NULL,
    "tunnelId"                    text,
    "currentSessionId"            text,
    "parentEnvironmentId"         text,
    "branchName"                  text,
    "git"                         jsonb,
    "archivedAt"                  timestamp(3) without time zone,
    "isBranchableEnvironment"     boolean NOT NULL DEFAULT false,
    CONSTRAINT "RuntimeEnvironment_pkey" PRIMARY KEY ("id"),
    CONSTRAINT "RuntimeEnvironment_organizationId_fkey" FOREIGN KEY ("organizationId")
        REFERENCES "Organization" ("id") ON DELETE CASCADE ON UPDATE CASCADE,
    CONSTRAINT "RuntimeEnvironment_projectId_fkey" FOREIGN KEY ("projectId")
        REFERENCES "Project" ("id") ON DELETE CASCADE ON UPDATE CASCADE,
    CONSTRAINT "RuntimeEnvironment_orgMemberId_fkey" FOREIGN KEY ("orgMemberId")
        REFERENCES "OrgMember" ("id") ON DELETE SET NULL ON UPDATE CASCADE,
    CONSTRAINT "RuntimeEnvironment_parentEnvironmentId_fkey" FOREIGN KEY ("parentEnvironmentId")
        REFERENCES "RuntimeEnvironment" ("id") ON DELETE CASCADE ON UPDATE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "RuntimeEnvironment_apiKey_key" ON "RuntimeEnvironment" ("apiKey");
CREATE UNIQUE INDEX IF NOT EXISTS "RuntimeEnvironment_pkApiKey_key" ON "RuntimeEnvironment" ("pkApiKey");
CREATE UNIQUE INDEX IF NOT EXISTS "RuntimeEnvironment_projectId_slug_orgMemberId_key"
    ON "RuntimeEnvironment" ("projectId", "slug", "orgMemberId");
CREATE UNIQUE INDEX IF NOT EXISTS "RuntimeEnvironment_projectId_shortcode_key"
    ON "RuntimeEnvironment" ("projectId", "shortcode");
CREATE INDEX IF NOT EXISTS "RuntimeEnvironment_parentEnvironmentId_idx"
    ON "RuntimeEnvironment" ("parentEnvironmentId");

-- ---------------------------------------------------------------------------------------------
-- "RevokedApiKey" (trigger-facts §1.7): the 24 h grace window after a root key rotation
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "RevokedApiKey" (
    "id"                   text NOT NULL,
    "apiKey"               text NOT NULL,
    "runtimeEnvironmentId" text NOT NULL,
    "expiresAt"            timestamp(3) without time zone NOT NULL,
    "createdAt"            timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    CONSTRAINT "RevokedApiKey_pkey" PRIMARY KEY ("id"),
    CONSTRAINT "RevokedApiKey_runtimeEnvironmentId_fkey" FOREIGN KEY ("runtimeEnvironmentId")
        REFERENCES "RuntimeEnvironment" ("id") ON DELETE CASCADE ON UPDATE CASCADE
);
CREATE INDEX IF NOT EXISTS "RevokedApiKey_apiKey_idx" ON "RevokedApiKey" ("apiKey");
CREATE INDEX IF NOT EXISTS "RevokedApiKey_runtimeEnvironmentId_idx" ON "RevokedApiKey" ("runtimeEnvironmentId");

-- ---------------------------------------------------------------------------------------------
-- api_keys (Prisma `ApiKey`, trigger-facts §1.8): additional environment keys
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "api_keys" (
    "id"                     text NOT NULL,
    "name"                   text NOT NULL,
    "key_hash"               text NOT NULL,
    "last_four"              text NOT NULL,
    "runtime_environment_id" text NOT NULL,
    "created_by_user_id"     text,
    "preset_id"              text,
    "scopes"                 text[] NOT NULL,
    "last_used_at"           timestamp(3) without time zone,
    "revoked_at"             timestamp(3) without time zone,
    "expires_at"             timestamp(3) without time zone,
    "created_at"             timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updated_at"             timestamp(3) without time zone NOT NULL,
    CONSTRAINT "api_keys_pkey" PRIMARY KEY ("id"),
    CONSTRAINT "api_keys_runtime_environment_id_fkey" FOREIGN KEY ("runtime_environment_id")
        REFERENCES "RuntimeEnvironment" ("id") ON DELETE CASCADE ON UPDATE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "api_keys_key_hash_key" ON "api_keys" ("key_hash");
CREATE INDEX IF NOT EXISTS "api_keys_runtime_environment_id_idx" ON "api_keys" ("runtime_environment_id");

-- ---------------------------------------------------------------------------------------------
-- "FeatureFlag" (trigger-facts §1.9): global flags (realtimeBackend, additionalApiKeyLookupEnabled)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "FeatureFlag" (
    "id"        text NOT NULL,
    "key"       text NOT NULL,
    "value"     jsonb,
    "createdAt" timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt" timestamp(3) without time zone NOT NULL,
    CONSTRAINT "FeatureFlag_pkey" PRIMARY KEY ("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "FeatureFlag_key_key" ON "FeatureFlag" ("key");

-- ---------------------------------------------------------------------------------------------
-- "BatchTaskRun" (trigger-facts §1.6): no FK to RuntimeEnvironment
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "BatchTaskRun" (
    "id"                   text NOT NULL,
    "friendlyId"           text NOT NULL,
    "idempotencyKey"       text,
    "idempotencyKeyExpiresAt" timestamp(3) without time zone,
    "runtimeEnvironmentId" text NOT NULL,
    "status"               "BatchTaskRunStatus" NOT NULL DEFAULT 'PENDING',
    "runtimeEnvironmentType" "RuntimeEnvironmentType",
    "runIds"               text[] DEFAULT '{}'::text[],
    "runCount"             integer NOT NULL DEFAULT 0,
    "payload"              text,
    "payloadType"          text NOT NULL DEFAULT 'application/json',
    "options"              jsonb,
    "batchVersion"         text NOT NULL DEFAULT 'v1',
    "completedAt"          timestamp(3) without time zone,
    "createdAt"            timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"            timestamp(3) without time zone NOT NULL,
    CONSTRAINT "BatchTaskRun_pkey" PRIMARY KEY ("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "BatchTaskRun_friendlyId_key" ON "BatchTaskRun" ("friendlyId");
CREATE UNIQUE INDEX IF NOT EXISTS "BatchTaskRun_runtimeEnvironmentId_idempotencyKey_key"
    ON "BatchTaskRun" ("runtimeEnvironmentId", "idempotencyKey");
CREATE INDEX IF NOT EXISTS "BatchTaskRun_runtimeEnvironmentId_id_idx"
    ON "BatchTaskRun" ("runtimeEnvironmentId", "id" DESC);
CREATE INDEX IF NOT EXISTS "BatchTaskRun_runtimeEnvironmentId_createdAt_id_idx"
    ON "BatchTaskRun" ("runtimeEnvironmentId", "createdAt" DESC, "id" DESC);

-- ---------------------------------------------------------------------------------------------
-- "TaskRun" (trigger-facts §1.3, §1.4): NO foreign keys (dropped upstream in
-- 20260401000000_drop_taskrun_foreign_keys). NOT NULL without default: id, payload,
-- runtimeEnvironmentId, projectId, updatedAt, taskIdentifier, friendlyId, spanId, traceId, queue.
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS "TaskRun" (
    "id"                       text NOT NULL,
    "number"                   integer NOT NULL DEFAULT 0,
    "friendlyId"               text NOT NULL,
    "engine"                   "RunEngineVersion" NOT NULL DEFAULT 'V1',
    "status"                   "TaskRunStatus" NOT NULL DEFAULT 'PENDING',
    "statusReason"             text,
    "idempotencyKey"           text,
    "idempotencyKeyExpiresAt"  timestamp(3) without time zone,
    "taskIdentifier"           text NOT NULL,
    "isTest"                   boolean NOT NULL DEFAULT false,
    "payload"                  text NOT NULL,
    "payloadType"              text NOT NULL DEFAULT 'application/json',
    "context"                  jsonb,
    "traceContext"             jsonb,
    "traceId"                  text NOT NULL,
    "spanId"                   text NOT NULL,
    "parentSpanId"             text,
    "runtimeEnvironmentId"     text NOT NULL,
    "projectId"                text NOT NULL,
    "organizationId"           text,
    "queue"                    text NOT NULL,
    "lockedQueueId"            text,
    "masterQueue"              text NOT NULL DEFAULT 'main',
    "secondaryMasterQueue"     text,
    "attemptNumber"            integer,
    "concurrencyKey"           text,
    "priorityMs"               integer NOT NULL DEFAULT 0,
    "createdAt"                timestamp(3) without time zone NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "updatedAt"                timestamp(3) without time zone NOT NULL,
    "lockedAt"                 timestamp(3) without time zone,
    "lockedById"               text,
    "lockedToVersionId"        text,
    "delayUntil"               timestamp(3) without time zone,
    "queuedAt"                 timestamp(3) without time zone,
    "ttl"                      text,
    "expiredAt"                timestamp(3) without time zone,
    "maxAttempts"              integer,
    "taskEventStore"           text NOT NULL DEFAULT 'taskEvent',
    "startedAt"                timestamp(3) without time zone,
    "executedAt"               timestamp(3) without time zone,
    "completedAt"              timestamp(3) without time zone,
    "machinePreset"            text,
    "usageDurationMs"          integer NOT NULL DEFAULT 0,
    "costInCents"              double precision NOT NULL DEFAULT 0,
    "baseCostInCents"          double precision NOT NULL DEFAULT 0,
    "scheduleId"               text,
    "scheduleInstanceId"       text,
    "metadata"                 text,
    "metadataType"             text NOT NULL DEFAULT 'application/json',
    "metadataVersion"          integer NOT NULL DEFAULT 1,
    "seedMetadata"             text,
    "seedMetadataType"         text NOT NULL DEFAULT 'application/json',
    "output"                   text,
    "outputType"               text NOT NULL DEFAULT 'application/json',
    "error"                    jsonb,
    "maxDurationInSeconds"     integer,
    "runTags"                  text[],
    "oneTimeUseToken"          text,
    "parentTaskRunId"          text,
    "rootTaskRunId"            text,
    "depth"                    integer NOT NULL DEFAULT 0,
    "batchId"                  text,
    "resumeParentOnCompletion" boolean NOT NULL DEFAULT false,
    "replayedFromTaskRunFriendlyId" text,
    "realtimeStreams"          text[] DEFAULT ARRAY[]::text[],
    "realtimeStreamsVersion"   text NOT NULL DEFAULT 'v1',
    "bulkActionGroupIds"       text[] DEFAULT ARRAY[]::text[],
    "planType"                 text,
    CONSTRAINT "TaskRun_pkey" PRIMARY KEY ("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "TaskRun_friendlyId_key" ON "TaskRun" ("friendlyId");
CREATE INDEX IF NOT EXISTS "TaskRun_runtimeEnvironmentId_batchId_idx"
    ON "TaskRun" ("runtimeEnvironmentId", "batchId");
CREATE INDEX IF NOT EXISTS "TaskRun_runtimeEnvironmentId_createdAt_idx"
    ON "TaskRun" ("runtimeEnvironmentId", "createdAt" DESC) INCLUDE ("id") WITH (fillfactor = 90);
CREATE INDEX IF NOT EXISTS "TaskRun_runTags_idx" ON "TaskRun" USING gin ("runTags");
CREATE INDEX IF NOT EXISTS "TaskRun_createdAt_idx" ON "TaskRun" USING brin ("createdAt");
