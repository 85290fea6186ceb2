//! Postgres access (sqlx). STUB: signatures fixed; the store helper implements them.
//!
//! Reads go to the read replica; lookups that must not 404 spuriously (run/batch by friendly
//! id, run by id for a snapshot) fall back to the primary on a miss (fix ae96b6c in trigger.dev).
//! `runfeed serve` never writes.

use async_trait::async_trait;

use crate::protocol::{ColumnSet, RunRow};

/// A database failure, with the operation it happened in.
#[derive(Debug, thiserror::Error)]
#[error("postgres {op}: {source}")]
pub struct StoreError {
    pub op: &'static str,
    #[source]
    pub source: sqlx::Error,
}

/// The run a `/realtime/v1/runs/:runId` URL names, with what scope checks need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunResource {
    /// Internal id.
    pub id: String,
    pub friendly_id: String,
    pub task_identifier: String,
    /// `runTags` (`[]` when null).
    pub tags: Vec<String>,
    /// Friendly id of the run's batch (`batch_…`), if any.
    pub batch_friendly_id: Option<String>,
}

/// The batch a `/realtime/v1/batches/:batchId` URL names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchResource {
    /// Internal id (what `"TaskRun"."batchId"` holds).
    pub id: String,
    pub friendly_id: String,
}

/// A `"RuntimeEnvironment"` row with what authentication needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvRecord {
    pub id: String,
    /// `PRODUCTION` | `STAGING` | `DEVELOPMENT` | `PREVIEW`.
    pub env_type: String,
    pub organization_id: String,
    pub project_id: String,
    pub api_key: String,
    pub parent_environment_id: Option<String>,
    /// The parent's `apiKey` (branch environments sign JWTs with it).
    pub parent_api_key: Option<String>,
    pub branch_name: Option<String>,
    pub archived: bool,
    /// `"Project"."deletedAt" IS NOT NULL`.
    pub project_deleted: bool,
}

/// Run reads the router and the feeds need. All reads are scoped to one environment.
#[async_trait]
pub trait RunStore: Send + Sync + 'static {
    /// Rows of `run_ids` in `env_id` (replica; missing ids are simply absent; order unspecified;
    /// ONE query whatever the number of ids). Columns outside `cols` are not fetched, except
    /// those the router always needs (id, updatedAt, createdAt, runTags, batchId + reserved).
    async fn hydrate(&self, env_id: &str, run_ids: &[String], cols: ColumnSet) -> Result<Vec<RunRow>, StoreError>;

    /// One run by internal id: replica, then primary on a miss.
    async fn read_run(&self, env_id: &str, run_id: &str, cols: ColumnSet) -> Result<Option<RunRow>, StoreError>;

    /// Tag feed run set: runs of `env_id` carrying ALL `tags` (`"runTags" @> tags`; no tags = no
    /// filter) with `"createdAt" >= floor_ms`, newest first (`createdAt DESC, id DESC`), at most
    /// `cap`. One query (resolve and hydrate together).
    async fn resolve_tag_set(&self, env_id: &str, tags: &[String], floor_ms: i64, cap: usize, cols: ColumnSet) -> Result<Vec<RunRow>, StoreError>;

    /// Batch feed run set: runs of `env_id` with `"batchId" = batch_id`, newest first, at most `cap`.
    async fn resolve_batch_set(&self, env_id: &str, batch_id: &str, cap: usize, cols: ColumnSet) -> Result<Vec<RunRow>, StoreError>;

    /// The run named by a friendly id in `env_id`: replica, then primary on a miss.
    async fn find_run(&self, env_id: &str, friendly_id: &str) -> Result<Option<RunResource>, StoreError>;

    /// The batch named by a friendly id in `env_id`: replica, then primary on a miss.
    async fn find_batch(&self, env_id: &str, friendly_id: &str) -> Result<Option<BatchResource>, StoreError>;
}

/// Environment and key lookups for authentication (replica).
#[async_trait]
pub trait EnvStore: Send + Sync + 'static {
    /// The environment whose `apiKey` equals `key`.
    async fn env_by_api_key(&self, key: &str) -> Result<Option<EnvRecord>, StoreError>;
    /// The environment of a `"RevokedApiKey"` row with this key and `expiresAt > now()`.
    async fn env_by_revoked_key(&self, key: &str) -> Result<Option<EnvRecord>, StoreError>;
    /// The environment with this id.
    async fn env_by_id(&self, id: &str) -> Result<Option<EnvRecord>, StoreError>;
    /// The non-archived child of `parent_id` with `branchName = branch`.
    async fn branch_env(&self, parent_id: &str, branch: &str) -> Result<Option<EnvRecord>, StoreError>;
    /// Unexpired revoked keys of `env_id` (JWT grace retry).
    async fn revoked_keys(&self, env_id: &str) -> Result<Vec<String>, StoreError>;
}

/// The Postgres implementation: a primary pool and a replica pool (the same URL when no replica
/// is configured). Counts the queries it issues ([`PgStore::query_count`]).
pub struct PgStore {
    _priv: (),
}

impl PgStore {
    /// Connects both pools (lazily; the first query connects).
    pub fn connect_lazy(primary_url: &str, replica_url: Option<&str>) -> Result<PgStore, StoreError> {
        let _ = (primary_url, replica_url);
        unimplemented!("store helper")
    }

    /// Runs a trivial query on both pools (readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        unimplemented!("store helper")
    }

    /// Total queries issued by this store so far (tests and the bench count hydrates with it).
    pub fn query_count(&self) -> u64 {
        unimplemented!("store helper")
    }

    /// The primary pool (CLI commands: migrate, demo, token).
    pub fn primary(&self) -> &sqlx::PgPool {
        unimplemented!("store helper")
    }
}

/// Applies `migrations/` (the trigger.dev tables runfeed reads) to `pool`. Idempotent.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let _ = pool;
    unimplemented!("store helper")
}
