//! Reusable database fixtures: throwaway databases, environments, runs and batches written the
//! way trigger.dev writes them (docs/trigger-dev.md §1). Used by `runfeed-demo`, `runfeed-bench`
//! and the integration tests.
//!
//! Conventions:
//! - Ids are cuid-like (`c` + 24 lowercase alphanumerics); run friendly ids are engine-V2 style
//!   `run_<id>`, batch friendly ids `batch_<id>`.
//! - Every timestamp is written explicitly as a UTC wall-clock `timestamp(3)` (the columns have no
//!   zone, and `"updatedAt"` has no default), so results do not depend on the session `TimeZone`.
//! - `"updatedAt"` is set to the current UTC time truncated to milliseconds and READ BACK from
//!   the committed row, so the returned `updated_at_ms` is exactly what a reader will see (the
//!   `updatedAtMs` watermark of a change record). [`update_run`] additionally guarantees that the
//!   new `"updatedAt"` is strictly greater than the previous one (at least +1 ms), so every update
//!   is visible to a feed that compares millisecond watermarks.

use anyhow::Context;
use rand::distr::Alphanumeric;
use rand::Rng;
use runfeed::store::setup;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};

/// SQL for "now" as a UTC `timestamp(3)` value (truncated, never rounded up into the future).
const NOW_UTC_MS: &str = "date_trunc('milliseconds', clock_timestamp() AT TIME ZONE 'UTC')";

/// An organization + project + runtime environment created by [`create_env`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemoEnv {
    /// Internal `"RuntimeEnvironment".id`.
    pub env_id: String,
    /// The environment's own root secret key (`"apiKey"`, e.g. `tr_dev_…`). For a branch
    /// environment ([`create_branch_env`]) public tokens are signed with the PARENT's key.
    pub api_key: String,
    /// `"Organization".id`.
    pub org_id: String,
    /// `"Project".id`.
    pub project_id: String,
}

/// What [`create_run`] inserts. Everything has a sensible default ([`RunSpec::default`]): a
/// `PENDING` run of task `demo-task`, payload `{"hello":"world"}`, no tags (`"runTags"` NULL,
/// as the run engine writes for a tagless run), created and updated now.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Internal id; random cuid-like when `None`.
    pub id: Option<String>,
    /// Friendly id; `run_<id>` when `None`.
    pub friendly_id: Option<String>,
    /// `"runTags"`: `None` writes SQL NULL, `Some(vec![])` writes `{}`.
    pub tags: Option<Vec<String>>,
    /// `"batchId"`: the INTERNAL batch id.
    pub batch_id: Option<String>,
    /// A `"TaskRunStatus"` label.
    pub status: String,
    pub task_identifier: String,
    /// `"createdAt"` (epoch ms); now when `None`.
    pub created_at_ms: Option<i64>,
    /// `"updatedAt"` (epoch ms); now when `None`.
    pub updated_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub completed_at_ms: Option<i64>,
    pub delay_until_ms: Option<i64>,
    pub queued_at_ms: Option<i64>,
    pub expired_at_ms: Option<i64>,
    pub payload: String,
    pub payload_type: String,
    pub metadata: Option<String>,
    pub metadata_type: String,
    pub output: Option<String>,
    pub output_type: String,
    /// `error` jsonb.
    pub error: Option<serde_json::Value>,
    pub is_test: bool,
    pub number: i32,
    pub usage_duration_ms: i32,
    pub cost_in_cents: f64,
    pub base_cost_in_cents: f64,
    pub ttl: Option<String>,
    /// `"realtimeStreams"`; `None` keeps the column default (`{}`).
    pub realtime_streams: Option<Vec<String>>,
    /// `queue`; `task/<taskIdentifier>` when `None`.
    pub queue: Option<String>,
    /// `"idempotencyKey"`.
    pub idempotency_key: Option<String>,
}

impl Default for RunSpec {
    fn default() -> Self {
        RunSpec {
            id: None,
            friendly_id: None,
            tags: None,
            batch_id: None,
            status: "PENDING".to_string(),
            task_identifier: "demo-task".to_string(),
            created_at_ms: None,
            updated_at_ms: None,
            started_at_ms: None,
            completed_at_ms: None,
            delay_until_ms: None,
            queued_at_ms: None,
            expired_at_ms: None,
            payload: r#"{"hello":"world"}"#.to_string(),
            payload_type: "application/json".to_string(),
            metadata: None,
            metadata_type: "application/json".to_string(),
            output: None,
            output_type: "application/json".to_string(),
            error: None,
            is_test: false,
            number: 0,
            usage_duration_ms: 0,
            cost_in_cents: 0.0,
            base_cost_in_cents: 0.0,
            ttl: None,
            realtime_streams: None,
            queue: None,
            idempotency_key: None,
        }
    }
}

/// A run written by [`create_run`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatedRun {
    /// Internal id.
    pub id: String,
    /// `run_<id>` (or the spec's override).
    pub friendly_id: String,
    /// The committed `"updatedAt"`, epoch ms.
    pub updated_at_ms: i64,
    /// The committed `"createdAt"`, epoch ms.
    pub created_at_ms: i64,
}

/// A timestamp column change in [`RunUpdate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stamp {
    /// The current UTC time (ms precision).
    Now,
    /// This epoch-ms value.
    At(i64),
    /// SQL NULL.
    Null,
}

/// Changes applied by [`update_run`]; `None` leaves a column unchanged. `"updatedAt"` is always
/// bumped.
#[derive(Clone, Debug, Default)]
pub struct RunUpdate {
    /// A `"TaskRunStatus"` label.
    pub status: Option<String>,
    /// `metadata` text (JSON as text, like the webapp stores it).
    pub metadata: Option<String>,
    /// `output` text.
    pub output: Option<String>,
    /// `error` jsonb.
    pub error: Option<serde_json::Value>,
    /// `"runTags"` replaced wholesale (`Some(vec![])` writes `{}`).
    pub tags: Option<Vec<String>>,
    pub started_at: Option<Stamp>,
    pub completed_at: Option<Stamp>,
    pub usage_duration_ms: Option<i32>,
    pub cost_in_cents: Option<f64>,
    pub base_cost_in_cents: Option<f64>,
    /// Write exactly this `"updatedAt"` (epoch ms) instead of "now, strictly after the previous
    /// value" (for tests of same-millisecond or backwards updates).
    pub updated_at_ms: Option<i64>,
}

fn random_alnum_lower(len: usize) -> String {
    const CHARS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

fn random_alnum(len: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

/// A new cuid-like id: `c` followed by 24 lowercase alphanumerics (25 chars, like Prisma's cuid).
pub fn new_id() -> String {
    format!("c{}", random_alnum_lower(24))
}

/// The root-key prefix trigger.dev uses for an environment type (`utils/apiKeys.ts`).
pub fn api_key_prefix(env_type: &str) -> &'static str {
    match env_type {
        "PRODUCTION" => "tr_prod_",
        "STAGING" => "tr_stg_",
        "PREVIEW" => "tr_preview_",
        _ => "tr_dev_",
    }
}

/// A new root secret key for `env_type`: prefix + 24 characters of `[0-9a-zA-Z]`.
pub fn new_api_key(env_type: &str) -> String {
    format!("{}{}", api_key_prefix(env_type), random_alnum(24))
}

fn check_env_type(env_type: &str) -> anyhow::Result<()> {
    match env_type {
        "PRODUCTION" | "STAGING" | "DEVELOPMENT" | "PREVIEW" => Ok(()),
        other => anyhow::bail!(
            "unknown environment type {other:?} (expected PRODUCTION, STAGING, DEVELOPMENT or PREVIEW)"
        ),
    }
}

/// Inserts a fresh organization, project and runtime environment of `env_type`
/// (`PRODUCTION` | `STAGING` | `DEVELOPMENT` | `PREVIEW`) with random ids, slugs and key: the
/// minimal fixture of docs/trigger-dev.md §1.9.
pub async fn create_env(pool: &PgPool, env_type: &str) -> anyhow::Result<DemoEnv> {
    let suffix = random_alnum_lower(10);
    create_env_named(
        pool,
        env_type,
        &format!("org-{suffix}"),
        &format!("proj-{suffix}"),
        &env_slug(env_type),
    )
    .await
}

fn env_slug(env_type: &str) -> String {
    match env_type {
        "PRODUCTION" => "prod",
        "STAGING" => "stg",
        "PREVIEW" => "preview",
        _ => "dev",
    }
    .to_string()
}

/// Like [`create_env`] with chosen organization/project/environment slugs (the organization and
/// project slugs must be unused). Used by the demo.
pub async fn create_env_named(
    pool: &PgPool,
    env_type: &str,
    org_slug: &str,
    project_slug: &str,
    env_slug: &str,
) -> anyhow::Result<DemoEnv> {
    let env = DemoEnv {
        env_id: new_id(),
        api_key: new_api_key(env_type),
        org_id: new_id(),
        project_id: new_id(),
    };
    let slugs = EnvSlugs {
        org: org_slug,
        project: project_slug,
        env: env_slug,
    };
    create_env_exact(pool, env_type, slugs, &env).await?;
    Ok(env)
}

/// The slugs of the organization, project and environment [`create_env_exact`] writes.
#[derive(Clone, Copy, Debug)]
pub struct EnvSlugs<'a> {
    /// `"Organization".slug` (must be unused).
    pub org: &'a str,
    /// `"Project".slug` (must be unused).
    pub project: &'a str,
    /// `"RuntimeEnvironment".slug`.
    pub env: &'a str,
}

/// Like [`create_env_named`] with the ids and key chosen by the caller (`env`): a generator that
/// must write the same environments from the same seed (`runfeed-bench gen`).
pub async fn create_env_exact(
    pool: &PgPool,
    env_type: &str,
    slugs: EnvSlugs<'_>,
    env: &DemoEnv,
) -> anyhow::Result<()> {
    check_env_type(env_type)?;
    let DemoEnv {
        env_id,
        api_key,
        org_id,
        project_id,
    } = env;
    let (org_slug, project_slug, env_slug) = (slugs.org, slugs.project, slugs.env);
    let mut tx = pool.begin().await.context("begin transaction")?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "Organization" (id, slug, title, "createdAt", "updatedAt")
           VALUES ($1, $2, $3, {NOW_UTC_MS}, {NOW_UTC_MS})"#
    )))
    .bind(org_id)
    .bind(org_slug)
    .bind(format!("Organization {org_slug}"))
    .execute(&mut *tx)
    .await
    .context("insert Organization")?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "Project" (id, name, "organizationId", slug, "externalRef", "createdAt", "updatedAt")
           VALUES ($1, $2, $3, $4, $5, {NOW_UTC_MS}, {NOW_UTC_MS})"#
    )))
    .bind(project_id)
    .bind(format!("Project {project_slug}"))
    .bind(org_id)
    .bind(project_slug)
    .bind(format!("proj_{}", random_alnum_lower(20)))
    .execute(&mut *tx)
    .await
    .context("insert Project")?;
    insert_env(
        &mut tx, env_id, env_type, env_slug, api_key, org_id, project_id, None, None,
    )
    .await?;
    tx.commit().await.context("commit environment fixture")?;
    Ok(())
}

/// Inserts a branch environment under `parent` (same organization and project,
/// `"parentEnvironmentId"` = parent, `"branchName"` = `branch`) with its own type and key.
/// Public tokens for it are signed with the parent's key (docs/trigger-dev.md §2.3).
pub async fn create_branch_env(
    pool: &PgPool,
    parent: &DemoEnv,
    env_type: &str,
    branch: &str,
) -> anyhow::Result<DemoEnv> {
    check_env_type(env_type)?;
    let env_id = new_id();
    let api_key = new_api_key(env_type);
    let slug = format!("{}-{}", env_slug(env_type), random_alnum_lower(8));
    let mut tx = pool.begin().await.context("begin transaction")?;
    insert_env(
        &mut tx,
        &env_id,
        env_type,
        &slug,
        &api_key,
        &parent.org_id,
        &parent.project_id,
        Some(&parent.env_id),
        Some(branch),
    )
    .await?;
    tx.commit()
        .await
        .context("commit branch environment fixture")?;
    Ok(DemoEnv {
        env_id,
        api_key,
        org_id: parent.org_id.clone(),
        project_id: parent.project_id.clone(),
    })
}

#[allow(clippy::too_many_arguments)]
async fn insert_env(
    tx: &mut sqlx::PgConnection,
    env_id: &str,
    env_type: &str,
    slug: &str,
    api_key: &str,
    org_id: &str,
    project_id: &str,
    parent_id: Option<&str>,
    branch: Option<&str>,
) -> anyhow::Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "RuntimeEnvironment"
             (id, slug, "apiKey", "pkApiKey", shortcode, type, "organizationId", "projectId",
              "parentEnvironmentId", "branchName", "createdAt", "updatedAt")
           VALUES ($1, $2, $3, $4, $5, $6::"RuntimeEnvironmentType", $7, $8, $9, $10, {NOW_UTC_MS}, {NOW_UTC_MS})"#
    )))
    .bind(env_id)
    .bind(slug)
    .bind(api_key)
    .bind(format!("pk_{}_{}", slug, random_alnum(20)))
    .bind(random_alnum_lower(8))
    .bind(env_type)
    .bind(org_id)
    .bind(project_id)
    .bind(parent_id)
    .bind(branch)
    .execute(tx)
    .await
    .context("insert RuntimeEnvironment")?;
    Ok(())
}

/// Inserts a `"BatchTaskRun"` in `env`; returns `(internal id, friendly id "batch_<id>")`.
/// Runs join it through `RunSpec::batch_id` = the internal id.
pub async fn create_batch(pool: &PgPool, env: &DemoEnv) -> anyhow::Result<(String, String)> {
    let id = new_id();
    let friendly_id = format!("batch_{id}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "BatchTaskRun" (id, "friendlyId", "runtimeEnvironmentId", "createdAt", "updatedAt")
           VALUES ($1, $2, $3, {NOW_UTC_MS}, {NOW_UTC_MS})"#
    )))
    .bind(&id)
    .bind(&friendly_id)
    .bind(&env.env_id)
    .execute(pool)
    .await
    .context("insert BatchTaskRun")?;
    Ok((id, friendly_id))
}

/// SQL turning the epoch-ms parameter `$n` (int8, may be NULL) into a UTC `timestamp`.
fn ms_to_ts(n: usize) -> String {
    format!("(timestamp '1970-01-01 00:00:00' + ${n}::int8 * interval '1 millisecond')")
}

/// SQL for a timestamp column's epoch ms (int8), exact for `timestamp(3)` values.
fn ts_to_ms(col: &str) -> String {
    format!("(extract(epoch from {col}) * 1000)::int8")
}

/// Inserts a `"TaskRun"` of `env` described by `spec`; returns its ids and the committed
/// `"updatedAt"`/`"createdAt"` (epoch ms).
pub async fn create_run(pool: &PgPool, env: &DemoEnv, spec: RunSpec) -> anyhow::Result<CreatedRun> {
    let id = spec.id.clone().unwrap_or_else(new_id);
    let friendly_id = spec
        .friendly_id
        .clone()
        .unwrap_or_else(|| format!("run_{id}"));
    let queue = spec
        .queue
        .clone()
        .unwrap_or_else(|| format!("task/{}", spec.task_identifier));
    let span_id = random_alnum_lower(16);
    let trace_id = random_alnum_lower(32);
    let created = format!("COALESCE({}, {NOW_UTC_MS})", ms_to_ts(11));
    let updated = format!("COALESCE({}, {NOW_UTC_MS})", ms_to_ts(12));
    let sql = format!(
        r#"INSERT INTO "TaskRun" (
             id, "friendlyId", "runtimeEnvironmentId", "projectId", "organizationId",
             "taskIdentifier", payload, "payloadType", "spanId", "traceId",
             "createdAt", "updatedAt", "startedAt", "completedAt", "delayUntil", "queuedAt", "expiredAt",
             queue, status, "runTags", "batchId", metadata, "metadataType", output, "outputType",
             error, "isTest", number, "usageDurationMs", "costInCents", "baseCostInCents", ttl,
             "realtimeStreams", "idempotencyKey", engine)
           VALUES (
             $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
             {created}, {updated}, {s13}, {s14}, {s15}, {s16}, {s17},
             $18, $19::"TaskRunStatus", $20, $21, $22, $23, $24, $25,
             $26, $27, $28, $29, $30, $31, $32,
             COALESCE($33, ARRAY[]::text[]), $34, 'V2')
           RETURNING {u}, {c}"#,
        s13 = ms_to_ts(13),
        s14 = ms_to_ts(14),
        s15 = ms_to_ts(15),
        s16 = ms_to_ts(16),
        s17 = ms_to_ts(17),
        u = ts_to_ms(r#""updatedAt""#),
        c = ts_to_ms(r#""createdAt""#),
    );
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&id)
        .bind(&friendly_id)
        .bind(&env.env_id)
        .bind(&env.project_id)
        .bind(&env.org_id)
        .bind(&spec.task_identifier)
        .bind(&spec.payload)
        .bind(&spec.payload_type)
        .bind(&span_id)
        .bind(&trace_id)
        .bind(spec.created_at_ms)
        .bind(spec.updated_at_ms)
        .bind(spec.started_at_ms)
        .bind(spec.completed_at_ms)
        .bind(spec.delay_until_ms)
        .bind(spec.queued_at_ms)
        .bind(spec.expired_at_ms)
        .bind(&queue)
        .bind(&spec.status)
        .bind(&spec.tags)
        .bind(&spec.batch_id)
        .bind(&spec.metadata)
        .bind(&spec.metadata_type)
        .bind(&spec.output)
        .bind(&spec.output_type)
        .bind(spec.error.as_ref().map(sqlx::types::Json))
        .bind(spec.is_test)
        .bind(spec.number)
        .bind(spec.usage_duration_ms)
        .bind(spec.cost_in_cents)
        .bind(spec.base_cost_in_cents)
        .bind(&spec.ttl)
        .bind(&spec.realtime_streams)
        .bind(&spec.idempotency_key)
        .fetch_one(pool)
        .await
        .with_context(|| format!("insert TaskRun {friendly_id}"))?;
    let updated_at_ms: i64 = row.try_get(0).context("read back updatedAt")?;
    let created_at_ms: i64 = row.try_get(1).context("read back createdAt")?;
    Ok(CreatedRun {
        id,
        friendly_id,
        updated_at_ms,
        created_at_ms,
    })
}

fn stamp_params(stamp: Option<Stamp>) -> (&'static str, Option<i64>) {
    match stamp {
        None => ("keep", None),
        Some(Stamp::Now) => ("now", None),
        Some(Stamp::At(ms)) => ("at", Some(ms)),
        Some(Stamp::Null) => ("null", None),
    }
}

/// Applies `set` to the run with internal id `run_id` and bumps `"updatedAt"` to the current
/// UTC time in ms, strictly after its previous value (or to `set.updated_at_ms` when given).
/// Returns the committed `"updatedAt"` (epoch ms): the `updatedAtMs` to publish. Fails if the
/// run does not exist.
pub async fn update_run(pool: &PgPool, run_id: &str, set: RunUpdate) -> anyhow::Result<i64> {
    update_run_if_exists(pool, run_id, set)
        .await?
        .with_context(|| format!("update TaskRun {run_id}: no such run"))
}

/// Sets `status` on every run of `run_ids` (internal ids, each at most once) in one statement
/// and bumps each one's `"updatedAt"` as [`update_run`] does (the current UTC time in ms,
/// strictly after its previous value). Returns `(run id, committed "updatedAt" in epoch ms)` for
/// each run that exists, in no particular order: one round trip for many changes (a load
/// generator's tick).
pub async fn update_runs_status(
    pool: &PgPool,
    run_ids: &[String],
    status: &str,
) -> anyhow::Result<Vec<(String, i64)>> {
    let sql = format!(
        r#"UPDATE "TaskRun" AS r SET
             status = $2::"TaskRunStatus",
             "updatedAt" = GREATEST({NOW_UTC_MS}, r."updatedAt" + interval '1 millisecond')
           FROM unnest($1::text[]) AS u(id)
           WHERE r.id = u.id
           RETURNING r.id, {u}"#,
        u = ts_to_ms(r#"r."updatedAt""#),
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(run_ids)
        .bind(status)
        .fetch_all(pool)
        .await
        .with_context(|| format!("update {} TaskRuns", run_ids.len()))?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get::<String, _>(0).context("read back id")?,
                row.try_get::<i64, _>(1).context("read back updatedAt")?,
            ))
        })
        .collect()
}

/// Like [`update_run`], but a missing run is `Ok(None)` instead of an error.
pub async fn update_run_if_exists(
    pool: &PgPool,
    run_id: &str,
    set: RunUpdate,
) -> anyhow::Result<Option<i64>> {
    let (started_mode, started_ms) = stamp_params(set.started_at);
    let (completed_mode, completed_ms) = stamp_params(set.completed_at);
    let stamp_sql = |col: &str, mode: usize, ms: usize| {
        format!(
            r#"CASE ${mode}::text WHEN 'keep' THEN {col} WHEN 'now' THEN {NOW_UTC_MS} WHEN 'null' THEN NULL
               ELSE {at} END"#,
            at = ms_to_ts(ms)
        )
    };
    let sql = format!(
        r#"UPDATE "TaskRun" SET
             status = COALESCE($2::"TaskRunStatus", status),
             metadata = CASE WHEN $3::text IS NULL THEN metadata ELSE $3 END,
             output = CASE WHEN $4::text IS NULL THEN output ELSE $4 END,
             error = CASE WHEN $5::jsonb IS NULL THEN error ELSE $5 END,
             "runTags" = CASE WHEN $6::bool THEN $7::text[] ELSE "runTags" END,
             "startedAt" = {started},
             "completedAt" = {completed},
             "usageDurationMs" = COALESCE($12::int4, "usageDurationMs"),
             "costInCents" = COALESCE($13::float8, "costInCents"),
             "baseCostInCents" = COALESCE($14::float8, "baseCostInCents"),
             "updatedAt" = COALESCE({explicit}, GREATEST({NOW_UTC_MS}, "updatedAt" + interval '1 millisecond'))
           WHERE id = $1
           RETURNING {u}"#,
        started = stamp_sql(r#""startedAt""#, 8, 9),
        completed = stamp_sql(r#""completedAt""#, 10, 11),
        explicit = ms_to_ts(15),
        u = ts_to_ms(r#""updatedAt""#),
    );
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(run_id)
        .bind(&set.status)
        .bind(&set.metadata)
        .bind(&set.output)
        .bind(set.error.as_ref().map(sqlx::types::Json))
        .bind(set.tags.is_some())
        .bind(&set.tags)
        .bind(started_mode)
        .bind(started_ms)
        .bind(completed_mode)
        .bind(completed_ms)
        .bind(set.usage_duration_ms)
        .bind(set.cost_in_cents)
        .bind(set.base_cost_in_cents)
        .bind(set.updated_at_ms)
        .fetch_optional(pool)
        .await
        .with_context(|| format!("update TaskRun {run_id}"))?;
    match row {
        Some(row) => Ok(Some(
            row.try_get::<i64, _>(0).context("read back updatedAt")?,
        )),
        None => Ok(None),
    }
}

/// The URL of database `name` on the server of `admin_url_base`
/// (e.g. `postgres://postgres@127.0.0.1:5432` + `x` → `postgres://postgres@127.0.0.1:5432/x`).
/// Query parameters of the base are kept.
pub fn database_url(admin_url_base: &str, name: &str) -> String {
    let (base, query) = match admin_url_base.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin_url_base, None),
    };
    // Strip an existing database path (the part after the authority).
    let base = match base.find("://") {
        Some(scheme_end) => {
            let after = &base[scheme_end + 3..];
            match after.find('/') {
                Some(slash) => &base[..scheme_end + 3 + slash],
                None => base,
            }
        }
        None => base.trim_end_matches('/'),
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

/// A throwaway database with the runfeed tables, for tests: `runfeed_t_<random>` on the server
/// of `admin_url_base`, created and migrated by [`TestDb::create`], removed by [`TestDb::cleanup`].
pub struct TestDb {
    /// Database name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// A pool connected to it.
    pub pool: PgPool,
    admin_url_base: String,
}

impl TestDb {
    /// Creates and migrates a fresh `runfeed_t_<random>` database.
    pub async fn create(admin_url_base: &str) -> anyhow::Result<TestDb> {
        let name = format!("runfeed_t_{}", random_alnum_lower(12));
        setup::create_database(admin_url_base, &name).await?;
        let url = database_url(admin_url_base, &name);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(setup::options_for(admin_url_base, &name)?)
            .await
            .with_context(|| format!("connect to {name}"))?;
        setup::migrate(&pool)
            .await
            .with_context(|| format!("migrate {name}"))?;
        Ok(TestDb {
            name,
            url,
            pool,
            admin_url_base: admin_url_base.to_string(),
        })
    }

    /// Closes the pool and drops the database.
    pub async fn cleanup(self) -> anyhow::Result<()> {
        self.pool.close().await;
        Ok(setup::drop_database(&self.admin_url_base, &self.name).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_url_replaces_the_database() {
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432/", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            database_url("postgres://u:p@h:1/db?sslmode=disable", "x"),
            "postgres://u:p@h:1/x?sslmode=disable"
        );
    }

    #[test]
    fn ids_and_keys_have_trigger_shapes() {
        let id = new_id();
        assert_eq!(id.len(), 25);
        assert!(id.starts_with('c'));
        let key = new_api_key("DEVELOPMENT");
        assert!(key.starts_with("tr_dev_"));
        assert_eq!(key.len(), "tr_dev_".len() + 24);
        assert!(key["tr_dev_".len()..]
            .chars()
            .all(|c| c.is_ascii_alphanumeric()));
        assert!(new_api_key("PRODUCTION").starts_with("tr_prod_"));
    }
}
