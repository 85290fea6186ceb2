//! [`PgStore`]: the Postgres implementation of [`RunStore`] and [`EnvStore`].

use std::collections::{BTreeSet, HashSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};

use super::sql::{
    decode_head, decode_run, ms_to_ts, RunQuery, SqlCache, HEADS_BY_ID, HEADS_CREATED_SINCE,
};
use super::tag_plan::{self, TagPlan, MATCHES_ESTIMATE, ORDERED_MAX_WINDOW, WINDOW_ESTIMATE};
use super::{
    BatchResource, EnvRecord, EnvStore, Found, HeadScope, RunResource, RunStore, StoreError,
};
use crate::cache::TtlCache;
use crate::protocol::{
    BatchId, ColumnSet, EnvId, FriendlyBatchId, FriendlyRunId, RunId, RunMeta, RunRow,
};
use crate::telemetry::metrics::Metrics;

/// How far apart two floors may be for one estimate to serve both, ms: a feed's floor moves
/// with the clock (bucketed to `feeds.runset_created_at_bucket_ms`), and a window's size barely
/// changes in a few minutes.
const ESTIMATE_FLOOR_TOLERANCE_MS: u64 = 5 * 60 * 1000;

/// Default pool size per pool (primary and replica each).
pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;
/// How long a query waits for a pooled connection before failing (`PoolTimedOut`).
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// How much longer than `database.statement_timeout_ms` runfeed waits for the answer to a query
/// before giving up on it itself ([`query_bound`]): the server cancels a statement at its
/// timeout and answers at once, unless it cannot answer at all (frozen, or a network that
/// drops packets without closing the connection).
pub const QUERY_TIMEOUT_MARGIN: Duration = Duration::from_secs(1);
/// The client-side bound of a query when `database.statement_timeout_ms` is 0 (the server's
/// own setting applies, unknown to runfeed): ([`query_bound`]).
pub const QUERY_TIMEOUT_FALLBACK: Duration = Duration::from_secs(30);

/// How long runfeed waits for the answer to one query on a connection, whatever the server
/// does: `statement_timeout_ms` + [`QUERY_TIMEOUT_MARGIN`], or [`QUERY_TIMEOUT_FALLBACK`] when
/// it is 0. Waiting for a pooled connection is bounded apart ([`ACQUIRE_TIMEOUT`]).
pub fn query_bound(statement_timeout_ms: u64) -> Duration {
    if statement_timeout_ms == 0 {
        QUERY_TIMEOUT_FALLBACK
    } else {
        Duration::from_millis(statement_timeout_ms).saturating_add(QUERY_TIMEOUT_MARGIN)
    }
}

/// The Postgres implementation: a primary pool and a replica pool (the same pool when no replica
/// is configured, or when reads are forced to the primary). Counts the queries it issues
/// ([`PgStore::query_count`]).
///
/// Replica reads go to the primary pool while a distinct replica is known to be out of
/// recovery (promoted: it no longer receives the primary's commits), and back to the replica
/// once it reports being in recovery again ([`PgStore::check_replica`]).
///
/// Connections carry `application_name=runfeed` and, when configured, a `statement_timeout`
/// startup option (note: PgBouncer rejects startup options unless told to ignore them; use 0
/// behind it). No session `TimeZone` is needed: timestamps are bound and decoded as
/// `timestamp without time zone` holding UTC, and "now" comparisons use
/// `now() AT TIME ZONE 'UTC'` (docs/trigger-dev.md §1.1).
///
/// Every query waits at most [`query_bound`] for its answer ([`PgStore::fetch_on`]): a frozen
/// server cannot enforce its own `statement_timeout`. A connection whose query did not finish
/// (timed out, or its caller gave up) is closed, never handed to the next query.
pub struct PgStore {
    primary: PgPool,
    replica: PgPool,
    /// The replica is a different pool from the primary (so a miss is worth re-reading there).
    distinct_replica: bool,
    /// The distinct replica was last seen out of recovery: replica reads go to the primary.
    replica_bypassed: AtomicBool,
    queries: AtomicU64,
    sql: SqlCache,
    /// How long a query waits for its answer ([`query_bound`]).
    query_bound: Duration,
    /// Instruments (acquire waits); no-op until [`PgStore::set_metrics`].
    metrics: std::sync::OnceLock<Arc<Metrics>>,
    /// The planner's estimates for the tag set's plan ([`tag_plan`]), with the floor (epoch
    /// ms) each was made for: by environment (no tags) its runs since the floor, by
    /// environment and tags those carrying the tags. Bound: 10 000 entries, each kept 60 s.
    estimates: TtlCache<(EnvId, Vec<String>), (i64, f64)>,
    /// Tag sets read by plan: [`TagPlan::Planner`], [`TagPlan::Ordered`].
    tag_plans: [AtomicU64; 2],
}

/// Errors of every [`PgStore`] in this process by kind (the `runfeed.pg.errors` metric):
/// connection (a query with no answer within [`query_bound`] too), pool_timeout, database,
/// other.
static ERRORS: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];
const ERROR_KINDS: [&str; 4] = ["connection", "pool_timeout", "database", "other"];

/// Counts `err` in the process-wide Postgres error counters.
pub(super) fn count_error(err: &sqlx::Error) {
    let kind = match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => 0,
        sqlx::Error::PoolTimedOut => 1,
        sqlx::Error::Database(_) => 2,
        _ => 3,
    };
    ERRORS[kind].fetch_add(1, Ordering::Relaxed);
}

/// Whether `err` says the connection itself is gone (closed by the server or the network, or
/// the server shutting down: SQLSTATE classes 08 and 57P), not that the statement failed. A
/// timeout is not: the server did not answer, and asking it again would only wait as long.
fn is_connection_lost(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(e) => e.kind() != std::io::ErrorKind::TimedOut,
        sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
        _ => false,
    }
}

/// The error of a query with no answer within `bound`: an I/O error of kind `TimedOut` (counted
/// as `connection`, and a 503 at the HTTP edge like every store failure).
fn timed_out(bound: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer within {} ms (database.statement_timeout_ms and a margin); the connection is closed",
            bound.as_millis()
        ),
    ))
}

/// A pooled connection running one query: back to the pool once the query finished (with rows
/// or an error), closed instead when dropped before that (the query timed out, or the caller
/// gave up on it). sqlx would otherwise ping it on its way back, and that ping waits as long as
/// an unanswered query: on a frozen server, forever, holding the pool's slot.
struct Running {
    conn: PoolConnection<Postgres>,
    finished: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

/// The rows of `query` on `conn`, waiting at most `bound` for them ([`Running`]).
async fn fetch_bounded(
    conn: PoolConnection<Postgres>,
    bound: Duration,
    query: PgQuery<'_>,
) -> Result<Vec<PgRow>, sqlx::Error> {
    let mut running = Running {
        conn,
        finished: false,
    };
    let rows = tokio::time::timeout(bound, query.fetch_all(&mut *running.conn))
        .await
        .map_err(|_| timed_out(bound))?;
    running.finished = true;
    rows
}

fn store_err(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| {
        count_error(&source);
        StoreError { op, source }
    }
}

fn pool_for(
    url: &str,
    max_connections: u32,
    statement_timeout_ms: u64,
) -> Result<PgPool, StoreError> {
    let mut options = PgConnectOptions::from_str(url)
        .map_err(store_err("connect"))?
        .application_name("runfeed");
    if statement_timeout_ms > 0 {
        options = options.options([("statement_timeout", statement_timeout_ms.to_string())]);
    }
    Ok(PgPoolOptions::new()
        .max_connections(max_connections.max(1))
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_lazy_with(options))
}

const SQL_ENV_BY_REVOKED_KEY: &str = r#"SELECT e.id, e.type::text AS env_type, e."organizationId", e."projectId", e."apiKey", e."parentEnvironmentId", p."apiKey" AS parent_api_key, e."branchName", (e."archivedAt" IS NOT NULL) AS archived, (pr."deletedAt" IS NOT NULL) AS project_deleted FROM "RevokedApiKey" r JOIN "RuntimeEnvironment" e ON e.id = r."runtimeEnvironmentId" JOIN "Project" pr ON pr.id = e."projectId" LEFT JOIN "RuntimeEnvironment" p ON p.id = e."parentEnvironmentId" WHERE r."apiKey" = $1 AND r."expiresAt" > (now() AT TIME ZONE 'UTC') LIMIT 1"#;
const SQL_REVOKED_KEYS: &str = r#"SELECT "apiKey" FROM "RevokedApiKey" WHERE "runtimeEnvironmentId" = $1 AND "expiresAt" > (now() AT TIME ZONE 'UTC')"#;
/// A resource looked up by its URL id: `$1` friendly id, `$2` environment.
struct Lookup<T> {
    /// The statement.
    sql: &'static str,
    /// The operation named in a [`StoreError`].
    op: &'static str,
    /// The row's decoding.
    decode: fn(&PgRow) -> Result<T, sqlx::Error>,
}

/// A run by `friendlyId`, with its tags and its batch's friendly id.
const FIND_RUN: Lookup<RunResource> = Lookup {
    sql: r#"SELECT r.id, r."friendlyId", r."taskIdentifier", r."runTags", b."friendlyId" AS batch_friendly_id FROM "TaskRun" r LEFT JOIN "BatchTaskRun" b ON b.id = r."batchId" WHERE r."friendlyId" = $1 AND r."runtimeEnvironmentId" = $2 LIMIT 1"#,
    op: "find_run",
    decode: |row| {
        Ok(RunResource {
            id: row.try_get("id")?,
            friendly_id: row.try_get("friendlyId")?,
            task_identifier: row.try_get("taskIdentifier")?,
            tags: row
                .try_get::<Option<Vec<String>>, _>("runTags")?
                .unwrap_or_default(),
            batch_friendly_id: row.try_get("batch_friendly_id")?,
        })
    },
};

/// A batch by `friendlyId`.
const FIND_BATCH: Lookup<BatchResource> = Lookup {
    sql: r#"SELECT id, "friendlyId" FROM "BatchTaskRun" WHERE "friendlyId" = $1 AND "runtimeEnvironmentId" = $2 LIMIT 1"#,
    op: "find_batch",
    decode: |row| {
        Ok(BatchResource {
            id: row.try_get("id")?,
            friendly_id: row.try_get("friendlyId")?,
        })
    },
};

/// An [`EnvRecord`] select over `"RuntimeEnvironment" e` (its project `pr`, its parent `p`)
/// followed by `$tail` (a `WHERE … LIMIT 1` clause). A macro so the statements stay `&'static str`.
macro_rules! env_sql {
    ($tail:literal) => {
        concat!(
            r#"SELECT e.id, e.type::text AS env_type, e."organizationId", e."projectId", e."apiKey", e."parentEnvironmentId", p."apiKey" AS parent_api_key, e."branchName", (e."archivedAt" IS NOT NULL) AS archived, (pr."deletedAt" IS NOT NULL) AS project_deleted FROM "RuntimeEnvironment" e JOIN "Project" pr ON pr.id = e."projectId" LEFT JOIN "RuntimeEnvironment" p ON p.id = e."parentEnvironmentId""#,
            $tail
        )
    };
}

const ENV_BY_API_KEY: &str = env_sql!(r#" WHERE e."apiKey" = $1 LIMIT 1"#);
const ENV_BY_ID: &str = env_sql!(r#" WHERE e.id = $1 LIMIT 1"#);
const BRANCH_ENV: &str = env_sql!(
    r#" WHERE e."parentEnvironmentId" = $1 AND e."branchName" = $2 AND e."archivedAt" IS NULL LIMIT 1"#
);

fn decode_env(row: &PgRow) -> Result<EnvRecord, sqlx::Error> {
    Ok(EnvRecord {
        id: row.try_get("id")?,
        env_type: row.try_get("env_type")?,
        organization_id: row.try_get("organizationId")?,
        project_id: row.try_get("projectId")?,
        api_key: row.try_get("apiKey")?,
        parent_environment_id: row.try_get("parentEnvironmentId")?,
        parent_api_key: row.try_get("parent_api_key")?,
        branch_name: row.try_get("branchName")?,
        archived: row.try_get("archived")?,
        project_deleted: row.try_get("project_deleted")?,
    })
}

impl PgStore {
    /// Connects both pools (lazily; the first query connects) with [`DEFAULT_MAX_CONNECTIONS`]
    /// per pool, [`ACQUIRE_TIMEOUT`], and the server's own statement timeout. `replica_url: None`
    /// → replica reads use the primary pool.
    ///
    /// Errors: `StoreError { op: "connect" }` when a URL does not parse.
    pub fn connect_lazy(
        primary_url: &str,
        replica_url: Option<&str>,
    ) -> Result<PgStore, StoreError> {
        Self::connect_lazy_with(primary_url, replica_url, DEFAULT_MAX_CONNECTIONS, 0, false)
    }

    /// Like [`PgStore::connect_lazy`] with explicit settings: `max_connections` per pool,
    /// `statement_timeout_ms` (0 = server default; every query also waits at most
    /// [`query_bound`] of it for its answer), and `reads_from_primary`: every read goes to
    /// the primary and no replica pool is built (trigger's
    /// `REALTIME_BACKEND_NATIVE_RUN_READS_FROM_PRIMARY=1`, behaviour HYD-05).
    ///
    /// Errors: `StoreError { op: "connect" }` when a URL does not parse.
    pub fn connect_lazy_with(
        primary_url: &str,
        replica_url: Option<&str>,
        max_connections: u32,
        statement_timeout_ms: u64,
        reads_from_primary: bool,
    ) -> Result<PgStore, StoreError> {
        let primary = pool_for(primary_url, max_connections, statement_timeout_ms)?;
        let replica = match replica_url {
            Some(url) if !reads_from_primary && url != primary_url => {
                Some(pool_for(url, max_connections, statement_timeout_ms)?)
            }
            _ => None,
        };
        Ok(PgStore {
            query_bound: query_bound(statement_timeout_ms),
            ..PgStore::from_pools(primary, replica)
        })
    }

    /// Builds a store over existing pools (tests, CLI). `replica: None` → reads use `primary`.
    /// Queries wait at most [`QUERY_TIMEOUT_FALLBACK`] for their answer.
    pub fn from_pools(primary: PgPool, replica: Option<PgPool>) -> PgStore {
        let distinct_replica = replica.is_some();
        let replica = replica.unwrap_or_else(|| primary.clone());
        PgStore {
            primary,
            replica,
            distinct_replica,
            replica_bypassed: AtomicBool::new(false),
            queries: AtomicU64::new(0),
            metrics: std::sync::OnceLock::new(),
            sql: SqlCache::default(),
            query_bound: query_bound(0),
            estimates: TtlCache::new(10_000, Duration::from_secs(60)),
            tag_plans: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// Runs `SELECT 1` on both pools (readiness; once when they are the same pool).
    ///
    /// Errors: `StoreError { op: "ping" }` (connection refused, acquire timeout, …).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.ping_primary().await?;
        self.ping_replica().await
    }

    /// Runs `SELECT 1` on the primary pool (readiness check `postgres`).
    ///
    /// Errors: `StoreError { op: "ping" }`.
    pub async fn ping_primary(&self) -> Result<(), StoreError> {
        self.ping_on(&self.primary).await
    }

    /// Runs `SELECT 1` on the replica pool when it is a distinct server (readiness check
    /// `postgres_replica`); `Ok` at once otherwise.
    ///
    /// Errors: `StoreError { op: "ping" }`.
    pub async fn ping_replica(&self) -> Result<(), StoreError> {
        if !self.distinct_replica {
            return Ok(());
        }
        self.ping_on(&self.replica).await
    }

    /// Runs `SELECT 1` on `pool`.
    async fn ping_on(&self, pool: &PgPool) -> Result<(), StoreError> {
        self.count();
        self.fetch_on(pool, "ping", || sqlx::query("SELECT 1"))
            .await?;
        Ok(())
    }

    /// Total queries issued by this store so far (tests and the bench count hydrates with it).
    pub fn query_count(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    /// Tag sets read so far by plan: `planner` (the plain statement, planned by Postgres) and
    /// `ordered` (the ordered scan of a small environment's window; `src/store/tag_plan.rs`).
    pub fn tag_plan_counts(&self) -> [(&'static str, u64); 2] {
        let [planner, ordered] = &self.tag_plans;
        [
            ("planner", planner.load(Ordering::Relaxed)),
            ("ordered", ordered.load(Ordering::Relaxed)),
        ]
    }

    /// Query errors of every store in this process by kind: `connection` (I/O, TLS, protocol,
    /// pool closed, no answer within [`query_bound`]), `pool_timeout`, `database` (SQL errors, statement timeouts), `other`
    /// (decoding, configuration). Exported as `runfeed.pg.errors`.
    pub fn error_counts() -> [(&'static str, u64); 4] {
        std::array::from_fn(|i| (ERROR_KINDS[i], ERRORS[i].load(Ordering::Relaxed)))
    }

    /// The primary pool (CLI commands: migrate, demo, token).
    pub fn primary(&self) -> &PgPool {
        &self.primary
    }

    /// The configured replica's pool (the primary pool when there is no distinct replica),
    /// whether or not replica reads go to it now.
    pub fn replica(&self) -> &PgPool {
        &self.replica
    }

    /// Whether a replica distinct from the primary is configured (`database.replica_url`).
    pub fn has_distinct_replica(&self) -> bool {
        self.distinct_replica
    }

    /// Whether replica reads go to the primary because the distinct replica was last seen out
    /// of recovery (the `runfeed.pg.replica_bypassed` gauge).
    pub fn replica_bypassed(&self) -> bool {
        self.replica_bypassed.load(Ordering::Relaxed)
    }

    /// Records what the distinct replica last said about recovery: out of recovery, replica
    /// reads go to the primary; in recovery, back to the replica. Logs each change once.
    pub(super) fn note_replica_recovery(&self, in_recovery: bool) {
        let bypass = !in_recovery;
        if self.replica_bypassed.swap(bypass, Ordering::Relaxed) == bypass {
            return;
        }
        if bypass {
            tracing::warn!("the read replica (database.replica_url) is not in recovery: it was promoted and no longer receives the primary's commits, so replica reads go to the primary (database.url) until it is a replica again");
        } else {
            tracing::info!("the read replica (database.replica_url) is in recovery again: replica reads go back to it");
        }
    }

    /// Whether replica reads go to a distinct replica now (configured and not bypassed): only
    /// then is a miss there worth reading again on the primary.
    fn reads_distinct_replica(&self) -> bool {
        self.distinct_replica && !self.replica_bypassed()
    }

    /// The pool replica reads go to now.
    fn read_pool(&self) -> &PgPool {
        if self.replica_bypassed() {
            &self.primary
        } else {
            &self.replica
        }
    }

    /// How to read a tag set ([`tag_plan`]): from the planner's estimates of the environment's
    /// window and, when that window is small enough, of its runs carrying `tags`. Both are kept
    /// ([`PgStore::estimates`]), so a filter read again (a backstop's re-read, the next cold
    /// snapshot) asks no more. An estimate that cannot be read leaves the choice to Postgres.
    async fn tag_plan(
        &self,
        env_id: &EnvId,
        tags: &[String],
        floor_ms: i64,
        cap: usize,
    ) -> TagPlan {
        let floor = ms_to_ts(floor_ms);
        let window_query = || {
            sqlx::query(WINDOW_ESTIMATE)
                .bind(env_id)
                .bind(floor)
                .persistent(false)
        };
        let window_key = (env_id.clone(), Vec::new());
        let Some(window) = self
            .kept_estimate(window_key, floor_ms, "window_estimate", window_query)
            .await
        else {
            return TagPlan::Planner;
        };
        if window > ORDERED_MAX_WINDOW {
            return TagPlan::Planner;
        }
        let matches_query = || {
            sqlx::query(MATCHES_ESTIMATE)
                .bind(env_id)
                .bind(tags)
                .bind(floor)
                .persistent(false)
        };
        let matches_key = (env_id.clone(), tags.to_vec());
        match self
            .kept_estimate(matches_key, floor_ms, "matches_estimate", matches_query)
            .await
        {
            Some(matches) => tag_plan::choose(window, matches, cap),
            None => TagPlan::Planner,
        }
    }

    /// The estimate kept for `key` when it was made for a floor within
    /// [`ESTIMATE_FLOOR_TOLERANCE_MS`] of `floor_ms`, else [`PgStore::estimate`] of `make()`,
    /// kept.
    async fn kept_estimate<'q>(
        &self,
        key: (EnvId, Vec<String>),
        floor_ms: i64,
        op: &'static str,
        make: impl Fn() -> PgQuery<'q>,
    ) -> Option<f64> {
        if let Some((made_for, rows)) = self.estimates.get(&key) {
            if made_for.abs_diff(floor_ms) <= ESTIMATE_FLOOR_TOLERANCE_MS {
                return Some(rows);
            }
        }
        let rows = self.estimate(op, make).await?;
        self.estimates.insert(key, (floor_ms, rows));
        Some(rows)
    }

    /// The estimated rows of `make()`'s `EXPLAIN (FORMAT JSON)`, on the replica; `None` when
    /// it cannot be read (logged at debug: the caller falls back to the planner's plan).
    async fn estimate<'q>(&self, op: &'static str, make: impl Fn() -> PgQuery<'q>) -> Option<f64> {
        self.count();
        let rows = match self.on_replica(|pool| self.fetch_on(pool, op, &make)).await {
            Ok(rows) => rows,
            Err(err) => {
                tracing::debug!(op, error = %err, "plan estimate failed; Postgres plans the tag set alone");
                return None;
            }
        };
        let explain: serde_json::Value = rows.first()?.try_get(0).ok()?;
        tag_plan::plan_rows(&explain)
    }

    fn count(&self) {
        self.queries.fetch_add(1, Ordering::Relaxed);
    }

    async fn read_one_on(
        &self,
        pool: &PgPool,
        env_id: &EnvId,
        run_id: &RunId,
        cols: ColumnSet,
    ) -> Found<RunRow> {
        let sql = self.sql.get(RunQuery::ReadOne, cols);
        self.count();
        let query = || {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(env_id)
                .bind(run_id)
        };
        let row = self.fetch_first_on(pool, "read_run", query).await?;
        row.map(|r| decode_run(&r, cols, 0))
            .transpose()
            .map_err(store_err("read_run"))
    }

    /// One row of `lookup` by `(friendly id, environment)` on `pool`.
    async fn find_on<T>(
        &self,
        pool: &PgPool,
        lookup: &Lookup<T>,
        env_id: &EnvId,
        friendly_id: &str,
    ) -> Found<T> {
        self.count();
        let query = || sqlx::query(lookup.sql).bind(friendly_id).bind(env_id);
        let row = self.fetch_first_on(pool, lookup.op, query).await?;
        row.as_ref()
            .map(lookup.decode)
            .transpose()
            .map_err(store_err(lookup.op))
    }

    /// [`Self::find_on`] on the replica, then on the primary on a miss.
    async fn find<T>(&self, lookup: &Lookup<T>, env_id: &EnvId, friendly_id: &str) -> Found<T> {
        self.replica_then_primary(|pool| self.find_on(pool, lookup, env_id, friendly_id))
            .await
    }

    /// `read` on the replica ([`Self::on_replica`]), then, when reads go to a distinct replica,
    /// on the primary on a miss: a row committed moments ago may not have replayed yet.
    async fn replica_then_primary<'a, T, F, Fut>(&'a self, read: F) -> Found<T>
    where
        F: Fn(&'a PgPool) -> Fut,
        Fut: std::future::Future<Output = Found<T>> + 'a,
    {
        if let Some(found) = self.on_replica(&read).await? {
            return Ok(Some(found));
        }
        if self.reads_distinct_replica() {
            return read(&self.primary).await;
        }
        Ok(None)
    }

    /// Records into `metrics` from now on (set once; later calls are ignored).
    pub fn set_metrics(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// A connection of `pool` from sqlx's `acquire` (which waits its turn, pings the idle
    /// connection it hands out, or connects), its wait for the pool recorded.
    async fn acquire_on(
        &self,
        pool: &PgPool,
        op: &'static str,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        let started = std::time::Instant::now();
        // Boxed: the acquire future is kilobytes, and only this slow path needs it.
        let conn = Box::pin(pool.acquire()).await.map_err(store_err(op))?;
        if let Some(metrics) = self.metrics.get() {
            metrics.pg_acquired(started.elapsed());
        }
        Ok(conn)
    }

    /// The rows of `make()` on a connection of `pool`: an idle one taken at once when nobody
    /// queues for the pool, else one from [`PgStore::acquire_on`]. The one way runfeed queries
    /// Postgres: every query waits at most [`query_bound`] for its answer, and a connection
    /// whose query did not finish is closed ([`Running`]).
    ///
    /// Taking an idle connection directly skips `acquire`'s ping (a Postgres round trip per
    /// read) and its future; sqlx pinged the connection when it took it back. When one turns
    /// out to be dead all the same (the server closed it while it sat in the pool), the read
    /// runs once more on a connection from `acquire`, as it would have in the first place:
    /// these reads have no side effects.
    ///
    /// Errors: `StoreError { op }`: acquiring (`PoolTimedOut` after [`ACQUIRE_TIMEOUT`]), the
    /// query (SQL, connection, an I/O `TimedOut` after [`query_bound`]), never a hang.
    pub(super) async fn fetch_on<'q>(
        &self,
        pool: &PgPool,
        op: &'static str,
        make: impl Fn() -> PgQuery<'q>,
    ) -> Result<Vec<PgRow>, StoreError> {
        if let Some(conn) = pool.try_acquire() {
            if let Some(metrics) = self.metrics.get() {
                metrics.pg_acquired(Duration::ZERO);
            }
            match fetch_bounded(conn, self.query_bound, make()).await {
                Err(err) if is_connection_lost(&err) => {
                    tracing::debug!(op, error = %err, "idle pooled connection was lost; reading again on another");
                }
                other => return other.map_err(store_err(op)),
            }
        }
        let conn = self.acquire_on(pool, op).await?;
        fetch_bounded(conn, self.query_bound, make())
            .await
            .map_err(store_err(op))
    }

    /// The first row of `make()` ([`PgStore::fetch_on`]), for statements of one row at most.
    pub(super) async fn fetch_first_on<'q>(
        &self,
        pool: &PgPool,
        op: &'static str,
        make: impl Fn() -> PgQuery<'q>,
    ) -> Found<PgRow> {
        Ok(self.fetch_on(pool, op, make).await?.into_iter().next())
    }

    /// Runs `read` on the replica (the primary while the replica is bypassed); when the standby
    /// cancelled it (a recovery conflict, a normal and transient condition of a hot standby),
    /// runs it again on the primary instead of failing the request.
    async fn on_replica<'a, T, F, Fut>(&'a self, read: F) -> Result<T, StoreError>
    where
        F: Fn(&'a PgPool) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>> + 'a,
    {
        let distinct = self.reads_distinct_replica();
        match read(self.read_pool()).await {
            Err(err) if distinct && err.is_recovery_conflict() => {
                tracing::debug!(op = err.op, error = %err.source, "replica read cancelled by recovery; reading the primary");
                read(&self.primary).await
            }
            other => other,
        }
    }

    /// The query `read` for `cols`, its parameters bound by `bind`, made anew at each call.
    /// Its statement is prepared and cached, except for a query whose plan must fit its
    /// parameters ([`RunQuery::custom_plan`]).
    fn statement<'q>(
        &self,
        read: RunQuery,
        cols: ColumnSet,
        bind: impl Fn(PgQuery<'q>) -> PgQuery<'q>,
    ) -> impl Fn() -> PgQuery<'q> {
        let sql = self.sql.get(read, cols);
        move || bind(sqlx::query(AssertSqlSafe(sql.clone())).persistent(!read.custom_plan()))
    }

    /// The runs [`Self::statement`] selects (on the replica, the primary after a recovery
    /// conflict), decoded from the first column on; `op` names the read in errors.
    async fn fetch_runs<'q>(
        &self,
        op: &'static str,
        read: RunQuery,
        cols: ColumnSet,
        bind: impl Fn(PgQuery<'q>) -> PgQuery<'q>,
    ) -> Result<Vec<RunRow>, StoreError> {
        let make = self.statement(read, cols, bind);
        self.count();
        let rows = self
            .on_replica(|pool| self.fetch_on(pool, op, &make))
            .await?;
        rows.iter()
            .map(|r| decode_run(r, cols, 0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(store_err(op))
    }

    async fn env_query(
        &self,
        op: &'static str,
        sql: &'static str,
        binds: &[&str],
    ) -> Found<EnvRecord> {
        self.count();
        let query = || {
            let mut query = sqlx::query(sql);
            for b in binds {
                query = query.bind(*b);
            }
            query
        };
        let row = self
            .on_replica(|pool| self.fetch_first_on(pool, op, query))
            .await?;
        row.map(|r| decode_env(&r))
            .transpose()
            .map_err(store_err(op))
    }
}

/// A Postgres query with its parameters bound, not yet run.
type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A `LIMIT` value for `cap` (Postgres `bigint`).
fn limit(cap: usize) -> i64 {
    i64::try_from(cap).unwrap_or(i64::MAX)
}

#[async_trait]
impl RunStore for PgStore {
    async fn hydrate(
        &self,
        env_id: &EnvId,
        run_ids: &[RunId],
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError> {
        if run_ids.is_empty() {
            return Ok(Vec::new());
        }
        self.fetch_runs("hydrate", RunQuery::Hydrate, cols, |q| {
            q.bind(env_id).bind(run_ids)
        })
        .await
    }

    async fn hydrate_many(
        &self,
        runs: &[(EnvId, RunId)],
        cols: ColumnSet,
    ) -> Result<Vec<(EnvId, RunRow)>, StoreError> {
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: HashSet<(&str, &str)> = runs
            .iter()
            .map(|(env, run)| (env.as_str(), run.as_str()))
            .collect();
        let ids: Vec<&str> = runs.iter().map(|(_, run)| run.as_str()).collect();
        let envs: BTreeSet<&str> = runs.iter().map(|(env, _)| env.as_str()).collect();
        let envs: Vec<&str> = envs.into_iter().collect();
        let make = self.statement(RunQuery::HydrateMany, cols, |q| q.bind(&ids).bind(&envs));
        self.count();
        let rows = self
            .on_replica(|pool| self.fetch_on(pool, "hydrate_many", &make))
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            // `envId` leads the select list ([`RunQuery::HydrateMany`]).
            let env: EnvId = row.try_get(0).map_err(store_err("hydrate_many"))?;
            let run = decode_run(row, cols, 1).map_err(store_err("hydrate_many"))?;
            // The ANY × ANY filter may match a pair nobody asked for: never hand it out.
            if wanted.contains(&(env.as_str(), run.id.as_str())) {
                out.push((env, run));
            }
        }
        Ok(out)
    }

    async fn read_run(&self, env_id: &EnvId, run_id: &RunId, cols: ColumnSet) -> Found<RunRow> {
        self.replica_then_primary(|pool| self.read_one_on(pool, env_id, run_id, cols))
            .await
    }

    async fn resolve_tag_set(
        &self,
        env_id: &EnvId,
        tags: &[String],
        floor_ms: i64,
        cap: usize,
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError> {
        let floor = ms_to_ts(floor_ms);
        if tags.is_empty() {
            self.fetch_runs("resolve_tag_set", RunQuery::TagSetUnfiltered, cols, |q| {
                q.bind(env_id).bind(floor).bind(limit(cap))
            })
            .await
        } else {
            let plan = self.tag_plan(env_id, tags, floor_ms, cap).await;
            self.tag_plans[plan as usize].fetch_add(1, Ordering::Relaxed);
            let kind = match plan {
                TagPlan::Ordered => RunQuery::TagSetOrdered,
                TagPlan::Planner => RunQuery::TagSet,
            };
            self.fetch_runs("resolve_tag_set", kind, cols, |q| {
                q.bind(env_id).bind(tags).bind(floor).bind(limit(cap))
            })
            .await
        }
    }

    async fn resolve_batch_set(
        &self,
        env_id: &EnvId,
        batch_id: &BatchId,
        cap: usize,
        cols: ColumnSet,
    ) -> Result<Vec<RunRow>, StoreError> {
        self.fetch_runs("resolve_batch_set", RunQuery::BatchSet, cols, |q| {
            q.bind(env_id).bind(batch_id).bind(limit(cap))
        })
        .await
    }

    async fn run_heads(
        &self,
        env_id: &EnvId,
        scope: HeadScope<'_>,
    ) -> Result<Option<Vec<RunMeta>>, StoreError> {
        let query = || match scope {
            HeadScope::Ids(ids) => sqlx::query(HEADS_BY_ID).bind(env_id).bind(ids),
            HeadScope::CreatedSince { from_ms, limit: n } => sqlx::query(HEADS_CREATED_SINCE)
                .bind(env_id)
                .bind(ms_to_ts(from_ms))
                .bind(limit(n)),
        };
        if matches!(scope, HeadScope::Ids(ids) if ids.is_empty()) {
            return Ok(Some(Vec::new()));
        }
        self.count();
        let rows = self
            .on_replica(|pool| self.fetch_on(pool, "run_heads", &query))
            .await?;
        rows.iter()
            .map(decode_head)
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(store_err("run_heads"))
    }

    async fn find_run(&self, env_id: &EnvId, friendly_id: &FriendlyRunId) -> Found<RunResource> {
        self.find(&FIND_RUN, env_id, friendly_id.as_str()).await
    }

    async fn find_batch(
        &self,
        env_id: &EnvId,
        friendly_id: &FriendlyBatchId,
    ) -> Found<BatchResource> {
        self.find(&FIND_BATCH, env_id, friendly_id.as_str()).await
    }
}

#[async_trait]
impl EnvStore for PgStore {
    async fn env_by_api_key(&self, key: &str) -> Found<EnvRecord> {
        self.env_query("env_by_api_key", ENV_BY_API_KEY, &[key])
            .await
    }

    async fn env_by_revoked_key(&self, key: &str) -> Found<EnvRecord> {
        self.env_query("env_by_revoked_key", SQL_ENV_BY_REVOKED_KEY, &[key])
            .await
    }

    async fn env_by_id(&self, id: &EnvId) -> Found<EnvRecord> {
        self.env_query("env_by_id", ENV_BY_ID, &[id]).await
    }

    async fn branch_env(&self, parent_id: &EnvId, branch: &str) -> Found<EnvRecord> {
        self.env_query("branch_env", BRANCH_ENV, &[parent_id, branch])
            .await
    }

    async fn revoked_keys(&self, env_id: &EnvId) -> Result<Vec<String>, StoreError> {
        self.count();
        let query = || sqlx::query(SQL_REVOKED_KEYS).bind(env_id);
        let rows = self
            .on_replica(|pool| self.fetch_on(pool, "revoked_keys", query))
            .await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>("apiKey"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(store_err("revoked_keys"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_waits_the_statement_timeout_and_a_margin_or_the_fallback_without_one() {
        assert_eq!(query_bound(10_000), Duration::from_millis(11_000));
        assert_eq!(query_bound(1), Duration::from_millis(1_001));
        assert_eq!(query_bound(0), QUERY_TIMEOUT_FALLBACK);
    }

    #[test]
    fn a_timeout_is_not_a_lost_connection_worth_reading_again() {
        let err = timed_out(Duration::from_secs(1));
        assert!(!is_connection_lost(&err));
        assert!(err.to_string().contains("1000 ms"), "{err}");
    }
}
