//! Postgres access (sqlx runtime API only: no compile-time-checked macros, so the crate builds
//! without a database).
//!
//! Reads go to the read replica; lookups that must not 404 spuriously (run/batch by friendly
//! id, run by id for a snapshot) fall back to the primary on a miss (fix ae96b6c in trigger.dev).
//! `runfeed serve` never writes.
//!
//! - [`RunStore`] / [`EnvStore`]: the seams the router, feeds and auth code against.
//! - [`PgStore`] (`pg.rs`): the Postgres implementation (primary + replica pools, query counter).
//! - `sql.rs`: SQL text per column set and row decoding into [`RunRow`].
//! - [`setup`]: creates a database and applies `migrations/` (`runfeed migrate`; development
//!   and tests only).

use async_trait::async_trait;

use crate::protocol::{
    BatchId, ColumnSet, EnvId, FriendlyBatchId, FriendlyRunId, OrgId, RunId, RunMeta, RunRow,
};

pub mod grants;
mod ids;
pub mod lag;
mod pg;
pub mod setup;
mod sql;
mod tag_plan;

pub use lag::{Lsn, ReplicaProbe, ReplicaStatus};
pub use pg::{PgStore, ACQUIRE_TIMEOUT, DEFAULT_MAX_CONNECTIONS};

/// A lookup's answer: the row, `None` when there is none, or the store's error.
pub type Found<T> = Result<Option<T>, StoreError>;

/// A database failure, with the operation it happened in.
#[derive(Debug, thiserror::Error)]
#[error("postgres {op}: {source}")]
pub struct StoreError {
    /// The [`PgStore`] operation (`hydrate`, `read_run`, `find_run`, `env_by_api_key`, `connect`, …).
    pub op: &'static str,
    /// The sqlx error (connection, pool timeout, SQL, or decoding a column).
    #[source]
    pub source: sqlx::Error,
}

impl StoreError {
    /// Whether a hot standby cancelled the statement because it conflicted with the WAL it
    /// replays (SQLSTATE 40001 "conflict with recovery", or 40P01 for the lock form): normal and
    /// transient on a replica, worth one more try elsewhere.
    pub fn is_recovery_conflict(&self) -> bool {
        matches!(&self.source, sqlx::Error::Database(e)
            if matches!(e.code().as_deref(), Some("40001") | Some("40P01")))
    }
}

/// The run a `/realtime/v1/runs/:runId` URL names, with what scope checks need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunResource {
    /// Internal id.
    pub id: RunId,
    pub friendly_id: FriendlyRunId,
    pub task_identifier: String,
    /// `runTags` (`[]` when null).
    pub tags: Vec<String>,
    /// Friendly id of the run's batch (`batch_…`), if any.
    pub batch_friendly_id: Option<FriendlyBatchId>,
}

/// The batch a `/realtime/v1/batches/:batchId` URL names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchResource {
    /// Internal id (what `"TaskRun"."batchId"` holds).
    pub id: BatchId,
    pub friendly_id: FriendlyBatchId,
}

/// A `"RuntimeEnvironment"` row with what authentication needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvRecord {
    pub id: EnvId,
    /// `PRODUCTION` | `STAGING` | `DEVELOPMENT` | `PREVIEW`.
    pub env_type: String,
    pub organization_id: OrgId,
    pub project_id: String,
    pub api_key: String,
    pub parent_environment_id: Option<EnvId>,
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
    async fn hydrate(
        &self,
        env_id: &EnvId,
        run_ids: &[RunId],
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError>;

    /// Rows of the `(environment, run)` pairs in `runs`, whatever their environments (replica;
    /// missing pairs are absent; a row is returned only for a pair that was asked for, so no
    /// environment sees another's rows). The default asks [`RunStore::hydrate`] once per
    /// environment; [`PgStore`] reads them all in ONE query.
    async fn hydrate_many(
        &self,
        runs: &[(EnvId, RunId)],
        cols: ColumnSet,
    ) -> Result<Vec<(EnvId, RunRow)>, StoreError> {
        let mut by_env: std::collections::BTreeMap<&EnvId, Vec<RunId>> =
            std::collections::BTreeMap::new();
        for (env, run) in runs {
            by_env.entry(env).or_default().push(run.clone());
        }
        let mut out = Vec::new();
        for (env, ids) in by_env {
            let rows = self.hydrate(env, &ids, cols).await?;
            out.extend(rows.into_iter().map(|row| (env.clone(), row)));
        }
        Ok(out)
    }

    /// One run by internal id: replica, then primary on a miss.
    async fn read_run(&self, env_id: &EnvId, run_id: &RunId, cols: ColumnSet) -> Found<RunRow>;

    /// Tag feed run set: runs of `env_id` carrying ALL `tags` (`"runTags" @> tags`; no tags = no
    /// filter) with `"createdAt" >= floor_ms`, newest first (`createdAt DESC, id DESC`), at most
    /// `cap`. One query (resolve and hydrate together); the Postgres store first asks the
    /// planner for its estimates, to choose the formulation (`src/store/tag_plan.rs`).
    async fn resolve_tag_set(
        &self,
        env_id: &EnvId,
        tags: &[String],
        floor_ms: i64,
        cap: usize,
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError>;

    /// Batch feed run set: runs of `env_id` with `"batchId" = batch_id`, newest first, at most `cap`.
    async fn resolve_batch_set(
        &self,
        env_id: &EnvId,
        batch_id: &BatchId,
        cap: usize,
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError>;

    /// Run heads (id, `updatedAt`, `createdAt`, tags, batch, whether the status is final; never
    /// the payload) of `env_id` in `scope` (replica). What a backstop compares against what its
    /// client has before it hydrates the few runs that moved. `Ok(None)`: this store cannot
    /// read heads, and callers re-read whole sets instead (the default).
    async fn run_heads(
        &self,
        env_id: &EnvId,
        scope: HeadScope<'_>,
    ) -> Result<Option<Vec<RunMeta>>, StoreError> {
        let _ = (env_id, scope);
        Ok(None)
    }

    /// The run named by a friendly id in `env_id`: replica, then primary on a miss.
    async fn find_run(&self, env_id: &EnvId, friendly_id: &FriendlyRunId) -> Found<RunResource>;

    /// The batch named by a friendly id in `env_id`: replica, then primary on a miss.
    async fn find_batch(
        &self,
        env_id: &EnvId,
        friendly_id: &FriendlyBatchId,
    ) -> Found<BatchResource>;
}

/// Which run heads [`RunStore::run_heads`] reads.
#[derive(Clone, Copy, Debug)]
pub enum HeadScope<'a> {
    /// These runs, by primary key (missing ids are absent).
    Ids(&'a [RunId]),
    /// The runs created at or after `from_ms` (epoch ms), newest first, at most `limit`: a
    /// bounded range of the `(runtimeEnvironmentId, createdAt)` index, whatever the history.
    CreatedSince { from_ms: i64, limit: usize },
}

/// Environment and key lookups for authentication (replica).
#[async_trait]
pub trait EnvStore: Send + Sync + 'static {
    /// The environment whose `apiKey` equals `key`.
    async fn env_by_api_key(&self, key: &str) -> Found<EnvRecord>;
    /// The environment of a `"RevokedApiKey"` row with this key and `expiresAt > now()`.
    async fn env_by_revoked_key(&self, key: &str) -> Found<EnvRecord>;
    /// The environment with this id.
    async fn env_by_id(&self, id: &EnvId) -> Found<EnvRecord>;
    /// The non-archived child of `parent_id` with `branchName = branch`.
    async fn branch_env(&self, parent_id: &EnvId, branch: &str) -> Found<EnvRecord>;
    /// Unexpired revoked keys of `env_id` (JWT grace retry).
    async fn revoked_keys(&self, env_id: &EnvId) -> Result<Vec<String>, StoreError>;
}
