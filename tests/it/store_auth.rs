//! Integration tests for `runfeed::store` (Postgres) and `runfeed::auth` against a real Postgres
//! at `postgres://postgres@127.0.0.1:5432` (trust auth; override with `RUNFEED_TEST_PG`).
//!
//! Each test creates its own database `runfeed_t_<random hex>` through the `postgres` maintenance
//! database, applies `runfeed::store::setup::migrate`, inserts the minimal docs/trigger-dev.md §1.9 fixture
//! (Organization → Project → RuntimeEnvironment → BatchTaskRun → TaskRun with only the NOT NULL
//! columns that have no default, plus what the test needs), and drops the database at the end
//! (best effort, also when the test panics).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDateTime;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use runfeed::auth::{mint_public_token, Ability, AuthError, Authenticator};
use runfeed::protocol::ColumnSet;
use runfeed::store::setup::migrate;
use runfeed::store::{EnvStore, PgStore, RunStore};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Row};

fn server_url() -> String {
    std::env::var("RUNFEED_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_string())
}

/// A scratch database, dropped on [`TestDb::cleanup`] or (best effort) on drop.
struct TestDb {
    name: String,
    url: String,
    pool: PgPool,
    dropped: bool,
}

impl TestDb {
    async fn create() -> TestDb {
        let name = format!("runfeed_t_{:016x}", rand::random::<u64>());
        let admin = PgPool::connect(&format!("{}/postgres", server_url()))
            .await
            .expect("connect to maintenance db");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&admin)
            .await
            .expect("create test database");
        admin.close().await;
        let url = format!("{}/{name}", server_url());
        // The fixture connection deliberately runs in a non-UTC session time zone: the store must
        // not depend on the session zone (timestamps are UTC wall clock, docs/trigger-dev.md §1.1).
        let options: PgConnectOptions = url.parse().expect("url");
        let options = options.options([("TimeZone", "Asia/Kolkata")]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .expect("connect test db");
        migrate(&pool).await.expect("migrate");
        TestDb {
            name,
            url,
            pool,
            dropped: false,
        }
    }

    fn store(&self) -> PgStore {
        PgStore::connect_lazy(&self.url, None).expect("store")
    }

    async fn cleanup(mut self) {
        self.pool.close().await;
        if let Ok(admin) = PgPool::connect(&format!("{}/postgres", server_url())).await {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            )))
            .execute(&admin)
            .await;
            admin.close().await;
        }
        self.dropped = true;
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let name = self.name.clone();
        // Runs on its own thread and runtime: we may be inside a panicking async test.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(admin) = PgPool::connect(&format!("{}/postgres", server_url())).await {
                    let _ = sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    )))
                    .execute(&admin)
                    .await;
                }
            });
        })
        .join();
    }
}

fn ts(s: &str) -> NaiveDateTime {
    NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.3f").expect("timestamp literal")
}

fn ms(s: &str) -> i64 {
    ts(s).and_utc().timestamp_millis()
}

/// Organization + Project (minimal columns). `deleted` sets `"Project"."deletedAt"`.
async fn org_project(pool: &PgPool, suffix: &str, deleted: bool) -> (String, String) {
    let org = format!("org_{suffix}");
    let project = format!("proj_{suffix}");
    sqlx::query(r#"INSERT INTO "Organization" (id, slug, title, "updatedAt") VALUES ($1, $1, 'Org', now())"#)
        .bind(&org)
        .execute(pool)
        .await
        .expect("org");
    sqlx::query(
        r#"INSERT INTO "Project" (id, name, "organizationId", "updatedAt", slug, "externalRef", "deletedAt")
           VALUES ($1, 'Project', $2, now(), $1, $1, CASE WHEN $3 THEN now() ELSE NULL END)"#,
    )
    .bind(&project)
    .bind(&org)
    .bind(deleted)
    .execute(pool)
    .await
    .expect("project");
    (org, project)
}

struct EnvFixture<'a> {
    id: &'a str,
    env_type: &'a str,
    api_key: &'a str,
    parent: Option<&'a str>,
    branch: Option<&'a str>,
    archived: bool,
}

async fn insert_env(pool: &PgPool, org: &str, project: &str, env: EnvFixture<'_>) {
    sqlx::query(
        r#"INSERT INTO "RuntimeEnvironment"
             (id, slug, "apiKey", "organizationId", "updatedAt", "projectId", "pkApiKey", shortcode, type,
              "parentEnvironmentId", "branchName", "archivedAt")
           VALUES ($1, $1, $2, $3, now(), $4, 'pk_' || $1, $1, $5::"RuntimeEnvironmentType", $6, $7,
                   CASE WHEN $8 THEN now() ELSE NULL END)"#,
    )
    .bind(env.id)
    .bind(env.api_key)
    .bind(org)
    .bind(project)
    .bind(env.env_type)
    .bind(env.parent)
    .bind(env.branch)
    .bind(env.archived)
    .execute(pool)
    .await
    .expect("env");
}

async fn simple_env(pool: &PgPool, org: &str, project: &str, id: &str, env_type: &str, key: &str) {
    insert_env(
        pool,
        org,
        project,
        EnvFixture {
            id,
            env_type,
            api_key: key,
            parent: None,
            branch: None,
            archived: false,
        },
    )
    .await;
}

/// Runs `sql` with the text parameters `args` ($1, $2, …).
async fn execute(pool: &PgPool, what: &str, sql: &'static str, args: &[&str]) {
    let mut query = sqlx::query(sql);
    for arg in args {
        query = query.bind(*arg);
    }
    query.execute(pool).await.expect(what);
}

/// A scratch database with the batch (`id`, `friendly_id`) of `env_a`.
async fn db_with_batch(id: &str, friendly_id: &str) -> TestDb {
    let db = TestDb::create().await;
    insert_batch(&db.pool, id, friendly_id, "env_a").await;
    db
}

async fn insert_batch(pool: &PgPool, id: &str, friendly_id: &str, env: &str) {
    let sql = r#"INSERT INTO "BatchTaskRun" (id, "friendlyId", "runtimeEnvironmentId", "updatedAt") VALUES ($1, $2, $3, now())"#;
    execute(pool, "batch", sql, &[id, friendly_id, env]).await;
}

struct RunFixture<'a> {
    id: &'a str,
    env: &'a str,
    created_at: &'a str,
    tags: Option<&'a [&'a str]>,
    batch: Option<&'a str>,
}

/// The 10 NOT NULL no-default TaskRun columns + createdAt, runTags, batchId.
async fn insert_run(pool: &PgPool, run: RunFixture<'_>) {
    let created = ts(run.created_at);
    let updated = created + chrono::Duration::milliseconds(7);
    let tags: Option<Vec<String>> = run.tags.map(|t| t.iter().map(|s| s.to_string()).collect());
    sqlx::query(
        r#"INSERT INTO "TaskRun"
             (id, payload, "runtimeEnvironmentId", "projectId", "updatedAt", "taskIdentifier", "friendlyId",
              "spanId", "traceId", queue, "createdAt", "runTags", "batchId")
           VALUES ($1, '{"n":1}', $2, 'proj_x', $3, 'my-task', 'run_' || $1, 'span', 'trace', 'task/my-task',
                   $4, $5, $6)"#,
    )
    .bind(run.id)
    .bind(run.env)
    .bind(updated)
    .bind(created)
    .bind(tags)
    .bind(run.batch)
    .execute(pool)
    .await
    .expect("run");
}

async fn run_at(pool: &PgPool, id: &str, env: &str, created_at: &str, tags: Option<&[&str]>) {
    batch_run_at(pool, (id, env, created_at), tags, None).await;
}

/// A run `(id, env, createdAt)` with `tags`, in the batch with internal id `batch` if any.
async fn batch_run_at(
    pool: &PgPool,
    (id, env, created_at): (&str, &str, &str),
    tags: Option<&[&str]>,
    batch: Option<&str>,
) {
    insert_run(
        pool,
        RunFixture {
            id,
            env,
            created_at,
            tags,
            batch,
        },
    )
    .await;
}

fn ids(rows: &[runfeed::protocol::RunRow]) -> Vec<String> {
    rows.iter().map(|r| r.id.to_string()).collect()
}

fn env_id(id: &str) -> runfeed::protocol::EnvId {
    runfeed::protocol::EnvId::from(id)
}

/// Runs `(id, createdAt, tags)` of environment `env`, without a batch.
async fn runs_at(pool: &PgPool, env: &str, runs: &[(&str, &str, Option<&[&str]>)]) {
    for (id, created_at, tags) in runs {
        run_at(pool, id, env, created_at, *tags).await;
    }
}

/// The ids of `env`'s run set for `tags` (all runs when empty) above `floor`, at most `cap`.
async fn tag_set(
    store: &PgStore,
    env: &str,
    tags: &[String],
    floor: i64,
    cap: usize,
) -> Vec<String> {
    let rows = store
        .resolve_tag_set(&env_id(env), tags, floor, cap, ColumnSet::ALL)
        .await
        .expect("resolve tag set");
    ids(&rows)
}

/// The ids of `env`'s runs in the batch with internal id `batch`, at most `cap`.
async fn batch_set(store: &PgStore, env: &str, batch: &str, cap: usize) -> Vec<String> {
    let batch = runfeed::protocol::BatchId::from(batch);
    let rows = store
        .resolve_batch_set(&env_id(env), &batch, cap, ColumnSet::ALL)
        .await
        .expect("resolve batch set");
    ids(&rows)
}

/// `find_run` of the friendly id `run_fid` in `env`.
async fn find_run(
    store: &PgStore,
    env: &str,
    run_fid: &str,
) -> Option<runfeed::store::RunResource> {
    let fid = runfeed::protocol::FriendlyRunId::from(run_fid);
    store.find_run(&env_id(env), &fid).await.expect("find run")
}

/// `find_batch` of the friendly id `batch_fid` in `env`.
async fn find_batch(
    store: &PgStore,
    env: &str,
    batch_fid: &str,
) -> Option<runfeed::store::BatchResource> {
    let found = store.find_batch(&env_id(env), &batch_fid.into()).await;
    found.expect("find batch")
}

/// `read_run` of the run with internal id `run` in `env`, all columns.
async fn read_run(store: &PgStore, env: &str, run: &str) -> Option<runfeed::protocol::RunRow> {
    let run = runfeed::protocol::RunId::from(run);
    store
        .read_run(&env_id(env), &run, ColumnSet::ALL)
        .await
        .expect("read run")
}

/// `hydrate` of the runs with internal ids `runs` in `env`.
async fn hydrate(
    store: &PgStore,
    env: &str,
    runs: &[&str],
    cols: ColumnSet,
) -> Vec<runfeed::protocol::RunRow> {
    let runs: Vec<runfeed::protocol::RunId> = runs.iter().map(|r| (*r).into()).collect();
    store
        .hydrate(&env_id(env), &runs, cols)
        .await
        .expect("hydrate")
}

// ------------------------------------------------------------------------------------------------
// Schema
// ------------------------------------------------------------------------------------------------

#[tokio::test]
async fn migrate_twice_is_idempotent_and_schema_matches_trigger_facts() {
    let db = TestDb::create().await;
    migrate(&db.pool).await.expect("second migrate is a no-op");

    let not_null_no_default = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            let rows = sqlx::query(
                "SELECT column_name::text FROM information_schema.columns
                 WHERE table_schema = 'public' AND table_name = $1 AND is_nullable = 'NO' AND column_default IS NULL",
            )
            .bind(table)
            .fetch_all(&pool)
            .await
            .expect("columns");
            rows.iter()
                .map(|r| r.get::<String, _>(0))
                .collect::<BTreeSet<_>>()
        }
    };
    for (table, columns) in [
        (
            "TaskRun",
            "id payload runtimeEnvironmentId projectId updatedAt taskIdentifier friendlyId spanId traceId queue",
        ),
        (
            "RuntimeEnvironment",
            "id slug apiKey organizationId updatedAt projectId pkApiKey shortcode",
        ),
        ("BatchTaskRun", "id friendlyId runtimeEnvironmentId updatedAt"),
        ("Organization", "id slug title updatedAt"),
        ("Project", "id name organizationId updatedAt slug externalRef"),
    ] {
        let want: BTreeSet<String> = columns.split(' ').map(str::to_string).collect();
        assert_eq!(not_null_no_default(table).await, want, "{table}");
    }

    let labels: Vec<String> = sqlx::query_scalar(
        r#"SELECT enumlabel::text FROM pg_enum WHERE enumtypid = '"TaskRunStatus"'::regtype ORDER BY enumsortorder"#,
    )
    .fetch_all(&db.pool)
    .await
    .expect("enum");
    assert_eq!(labels.first().map(String::as_str), Some("PENDING"));
    assert_eq!(labels.last().map(String::as_str), Some("DEQUEUED"));
    assert_eq!(labels.len(), 17);

    // TaskRun has no foreign keys; the feed indexes exist.
    let fks: i64 = sqlx::query_scalar(
        r#"SELECT count(*) FROM pg_constraint WHERE conrelid = '"TaskRun"'::regclass AND contype = 'f'"#,
    )
    .fetch_one(&db.pool)
    .await
    .expect("fks");
    assert_eq!(fks, 0);
    let indexes: Vec<String> =
        sqlx::query_scalar("SELECT indexname::text FROM pg_indexes WHERE tablename = 'TaskRun'")
            .fetch_all(&db.pool)
            .await
            .expect("indexes");
    for name in [
        "TaskRun_friendlyId_key",
        "TaskRun_runtimeEnvironmentId_batchId_idx",
        "TaskRun_runtimeEnvironmentId_createdAt_idx",
        "TaskRun_runTags_idx",
        "TaskRun_createdAt_idx",
    ] {
        assert!(
            indexes.iter().any(|i| i == name),
            "{name} missing: {indexes:?}"
        );
    }

    // Defaults a minimal fixture relies on.
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_a", "PRODUCTION", "tr_prod_a").await;
    run_at(&db.pool, "r1", "env_a", "2024-01-01 00:00:00.000", None).await;
    let row = sqlx::query(
        r#"SELECT status::text, number, "isTest", "payloadType", "realtimeStreams", "runTags", engine::text
           FROM "TaskRun" WHERE id = 'r1'"#,
    )
    .fetch_one(&db.pool)
    .await
    .expect("defaults");
    assert_eq!(row.get::<String, _>(0), "PENDING");
    assert_eq!(row.get::<i32, _>(1), 0);
    assert!(!row.get::<bool, _>(2));
    assert_eq!(row.get::<String, _>(3), "application/json");
    assert_eq!(row.get::<Option<Vec<String>>, _>(4), Some(vec![]));
    assert_eq!(row.get::<Option<Vec<String>>, _>(5), None);
    assert_eq!(row.get::<String, _>(6), "V1");
    db.cleanup().await;
}

// ------------------------------------------------------------------------------------------------
// RunStore
// ------------------------------------------------------------------------------------------------

/// The router's cross-environment hydrate: runs of several environments in ONE query, and only
/// the (environment, run) pairs that were asked for — a run id asked for under the wrong
/// environment is never returned, even though both ids appear in the query.
#[tokio::test]
async fn hydrate_many_reads_every_environment_in_one_query_and_only_the_pairs_asked_for() {
    use runfeed::protocol::{EnvId, RunId};
    let db = TestDb::create().await;
    run_at(&db.pool, "a1", "env_a", "2024-01-01 00:00:00.000", None).await;
    run_at(&db.pool, "b1", "env_b", "2024-01-01 00:00:00.000", None).await;
    run_at(&db.pool, "c1", "env_c", "2024-01-01 00:00:00.000", None).await;
    let pair = |env: &str, run: &str| (EnvId::from(env), RunId::from(run));
    let asked = [
        pair("env_a", "a1"),
        pair("env_b", "b1"),
        // Crossed pairs: both ids exist, but not in these environments.
        pair("env_a", "b1"),
        pair("env_b", "c1"),
        pair("env_c", "missing"),
    ];
    let store = db.store();
    let before = store.query_count();
    let rows = store
        .hydrate_many(&asked, ColumnSet::ALL)
        .await
        .expect("hydrate_many");
    assert_eq!(
        store.query_count() - before,
        1,
        "one query for three environments"
    );
    let mut got: Vec<(String, String)> = rows
        .iter()
        .map(|(env, row)| (env.to_string(), row.id.to_string()))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("env_a".to_string(), "a1".to_string()),
            ("env_b".to_string(), "b1".to_string())
        ]
    );
    db.cleanup().await;
}

#[tokio::test]
async fn hydrate_is_one_query_for_many_ids_and_scoped_to_the_env() {
    let db = TestDb::create().await;
    let mut wanted = Vec::new();
    for i in 0..40 {
        let id = format!("a{i:02}");
        run_at(&db.pool, &id, "env_a", "2024-01-01 00:00:00.000", None).await;
        wanted.push(id);
    }
    // Same id shape, other environment: never returned for env_a.
    run_at(&db.pool, "b00", "env_b", "2024-01-01 00:00:00.000", None).await;
    wanted.push("b00".into());
    wanted.push("missing".into());
    let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();

    let store = db.store();
    let before = store.query_count();
    let rows = hydrate(&store, "env_a", &wanted, ColumnSet::ALL).await;
    assert_eq!(
        store.query_count() - before,
        1,
        "one query whatever the number of ids"
    );
    let mut got = ids(&rows);
    got.sort();
    assert_eq!(got.len(), 40);
    assert!(!got.contains(&"b00".to_string()));

    let before = store.query_count();
    assert!(hydrate(&store, "env_a", &[], ColumnSet::ALL)
        .await
        .is_empty());
    assert_eq!(store.query_count(), before, "no ids → no query");

    let of_other_env = hydrate(&store, "env_b", &["a00"], ColumnSet::ALL).await;
    assert!(of_other_env.is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn hydrate_projection_skips_columns_but_keeps_router_columns() {
    let db = db_with_batch("batch_internal", "batch_friendly").await;
    let r1 = ("r1", "env_a", "2024-02-03 04:05:06.789");
    batch_run_at(&db.pool, r1, Some(&["t1"]), Some("batch_internal")).await;
    sqlx::query(r#"UPDATE "TaskRun" SET output = 'out', metadata = 'meta' WHERE id = 'r1'"#)
        .execute(&db.pool)
        .await
        .expect("update");
    let store = db.store();

    let cols = ColumnSet::from_skip_list(["payload", "output", "runTags", "updatedAt"]);
    let row = hydrate(&store, "env_a", &["r1"], cols)
        .await
        .pop()
        .expect("row");
    assert_eq!(row.payload, "", "skipped column is not fetched");
    assert_eq!(row.output, None);
    assert_eq!(row.metadata.as_deref(), Some("meta"));
    assert_eq!(row.payload_type, "application/json");
    // Always read: updatedAt, runTags, batchId and the reserved columns.
    assert_eq!(row.updated_at_ms, ms("2024-02-03 04:05:06.796"));
    assert_eq!(row.run_tags, Some(vec!["t1".to_string()]));
    assert_eq!(row.batch_id.as_deref(), Some("batch_internal"));
    assert_eq!(row.friendly_id, "run_r1");
    assert_eq!(row.task_identifier, "my-task");
    assert_eq!(row.status, "PENDING");

    let full = read_run(&store, "env_a", "r1").await.expect("found");
    assert_eq!(full.payload, r#"{"n":1}"#);
    assert_eq!(full.output.as_deref(), Some("out"));
    assert_eq!(full.realtime_streams, Some(vec![]));
    assert!(read_run(&store, "env_b", "r1").await.is_none());
    assert!(read_run(&store, "env_a", "nope").await.is_none());
    db.cleanup().await;
}

/// Every run read decodes every column of a fully populated run, whatever the projection: the
/// single read, the hydrate, the cross-environment hydrate (whose rows lead with the
/// environment), the tag set and the batch set agree column by column, and a skipped column
/// reads as its type's default.
#[tokio::test]
async fn every_run_read_decodes_each_column_of_its_projection() {
    use runfeed::protocol::{BatchId, Column, EnvId, RunId, RunRow};
    let db = db_with_batch("batch_internal", "batch_friendly").await;
    let r1 = ("r1", "env_a", "2024-02-03 04:05:06.789");
    batch_run_at(&db.pool, r1, Some(&["t1", "t2"]), Some("batch_internal")).await;
    sqlx::query(
        r#"UPDATE "TaskRun" SET "startedAt" = '2024-02-03 04:05:07.001', "delayUntil" = '2024-02-03 04:05:07.002',
             "queuedAt" = '2024-02-03 04:05:07.003', "expiredAt" = '2024-02-03 04:05:07.004',
             "completedAt" = '2024-02-03 04:05:07.005', number = 42, "isTest" = true, status = 'EXECUTING',
             "usageDurationMs" = 1234, "costInCents" = 0.55, "baseCostInCents" = 1.5, ttl = '10m',
             "payloadType" = 'text/plain', metadata = '{"m":1}', "metadataType" = 'application/super+json',
             output = '{"o":2}', "outputType" = 'application/store', error = '{"type": "STRING_ERROR", "raw": "boom"}'::jsonb,
             "realtimeStreams" = ARRAY['default', 'logs'] WHERE id = 'r1'"#,
    )
    .execute(&db.pool)
    .await
    .expect("update");
    let store = db.store();
    let full = read_run(&store, "env_a", "r1").await.expect("found");
    assert_eq!(full.started_at_ms, Some(ms("2024-02-03 04:05:07.001")));
    assert_eq!(full.delay_until_ms, Some(ms("2024-02-03 04:05:07.002")));
    assert_eq!(full.queued_at_ms, Some(ms("2024-02-03 04:05:07.003")));
    assert_eq!(full.expired_at_ms, Some(ms("2024-02-03 04:05:07.004")));
    assert_eq!(full.completed_at_ms, Some(ms("2024-02-03 04:05:07.005")));
    assert_eq!((full.number, full.is_test), (42, true));
    assert_eq!(full.status, "EXECUTING");
    assert_eq!(full.usage_duration_ms, 1234);
    assert_eq!((full.cost_in_cents, full.base_cost_in_cents), (0.55, 1.5));
    assert_eq!(full.ttl.as_deref(), Some("10m"));
    assert_eq!(full.payload, r#"{"n":1}"#);
    assert_eq!(full.payload_type, "text/plain");
    assert_eq!(full.metadata.as_deref(), Some(r#"{"m":1}"#));
    assert_eq!(full.metadata_type, "application/super+json");
    assert_eq!(full.output.as_deref(), Some(r#"{"o":2}"#));
    assert_eq!(full.output_type, "application/store");
    assert_eq!(
        full.error,
        Some(json!({"type": "STRING_ERROR", "raw": "boom"}))
    );
    assert_eq!(
        full.realtime_streams,
        Some(vec!["default".to_string(), "logs".to_string()])
    );
    assert_eq!(
        full.run_tags,
        Some(vec!["t1".to_string(), "t2".to_string()])
    );
    assert_eq!(full.batch_id.as_deref(), Some("batch_internal"));

    // What a read with `cols` must give: the full row with the skipped columns at their defaults.
    let expected = |cols: ColumnSet| {
        let mut row = full.clone();
        let keep = |c: Column| cols.contains(c);
        if !keep(Column::StartedAt) {
            row.started_at_ms = None;
        }
        if !keep(Column::DelayUntil) {
            row.delay_until_ms = None;
        }
        if !keep(Column::QueuedAt) {
            row.queued_at_ms = None;
        }
        if !keep(Column::ExpiredAt) {
            row.expired_at_ms = None;
        }
        if !keep(Column::CompletedAt) {
            row.completed_at_ms = None;
        }
        if !keep(Column::Number) {
            row.number = 0;
        }
        if !keep(Column::IsTest) {
            row.is_test = false;
        }
        if !keep(Column::UsageDurationMs) {
            row.usage_duration_ms = 0;
        }
        if !keep(Column::CostInCents) {
            row.cost_in_cents = 0.0;
        }
        if !keep(Column::BaseCostInCents) {
            row.base_cost_in_cents = 0.0;
        }
        if !keep(Column::Ttl) {
            row.ttl = None;
        }
        if !keep(Column::Payload) {
            row.payload = String::new();
        }
        if !keep(Column::PayloadType) {
            row.payload_type = String::new();
        }
        if !keep(Column::Metadata) {
            row.metadata = None;
        }
        if !keep(Column::MetadataType) {
            row.metadata_type = String::new();
        }
        if !keep(Column::Output) {
            row.output = None;
        }
        if !keep(Column::OutputType) {
            row.output_type = String::new();
        }
        if !keep(Column::Error) {
            row.error = None;
        }
        if !keep(Column::RealtimeStreams) {
            row.realtime_streams = None;
        }
        row
    };
    let projections = [
        ColumnSet::ALL,
        ColumnSet::from_skip_list(["payload", "output"]),
        ColumnSet::from_skip_list(["startedAt", "number", "costInCents", "metadata", "error"]),
        ColumnSet::from_skip_list([
            "delayUntil",
            "isTest",
            "ttl",
            "payloadType",
            "realtimeStreams",
        ]),
        ColumnSet::from_skip_list([
            "startedAt",
            "delayUntil",
            "queuedAt",
            "expiredAt",
            "completedAt",
            "number",
            "isTest",
            "usageDurationMs",
            "costInCents",
            "baseCostInCents",
            "ttl",
            "payload",
            "payloadType",
            "metadata",
            "metadataType",
            "output",
            "outputType",
            "error",
            "realtimeStreams",
        ]),
    ];
    let env = EnvId::from("env_a");
    for cols in projections {
        let want: RunRow = expected(cols);
        let skipped = cols.skipped();
        let one = store
            .read_run(&env, &RunId::from("r1"), cols)
            .await
            .expect("read_run")
            .expect("found");
        assert_eq!(one, want, "read_run skipping {skipped:?}");
        let hydrated = store
            .hydrate(&env, &[RunId::from("r1")], cols)
            .await
            .expect("hydrate");
        assert_eq!(hydrated, vec![want.clone()], "hydrate skipping {skipped:?}");
        let many = store
            .hydrate_many(&[(env.clone(), RunId::from("r1"))], cols)
            .await
            .expect("hydrate_many");
        assert_eq!(
            many,
            vec![(env.clone(), want.clone())],
            "hydrate_many skipping {skipped:?}"
        );
        let tagged = store
            .resolve_tag_set(&env, &["t1".to_string()], 0, 10, cols)
            .await
            .expect("tag set");
        assert_eq!(
            tagged,
            vec![want.clone()],
            "resolve_tag_set skipping {skipped:?}"
        );
        let batch = store
            .resolve_batch_set(&env, &BatchId::from("batch_internal"), 10, cols)
            .await
            .expect("batch set");
        assert_eq!(batch, vec![want], "resolve_batch_set skipping {skipped:?}");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn resolve_tag_set_contains_all_tags_respects_floor_newest_first_and_cap() {
    let db = TestDb::create().await;
    let ab: &[&str] = &["a", "b"];
    let runs_of_a: [(&str, &str, Option<&[&str]>); 7] = [
        ("old", "2024-01-01 00:00:00.000", Some(ab)),
        ("at_floor", "2024-01-02 00:00:00.000", Some(ab)),
        ("only_a", "2024-01-03 00:00:00.000", Some(&["a"])),
        ("abc", "2024-01-04 00:00:00.000", Some(&["c", "b", "a"])),
        ("ab_tie_x", "2024-01-05 00:00:00.000", Some(ab)),
        ("ab_tie_y", "2024-01-05 00:00:00.000", Some(&["b", "a"])),
        ("untagged", "2024-01-06 00:00:00.000", None),
    ];
    runs_at(&db.pool, "env_a", &runs_of_a).await;
    runs_at(
        &db.pool,
        "env_b",
        &[("other_env", "2024-01-06 00:00:00.000", Some(ab))],
    )
    .await;
    let store = db.store();
    let floor = ms("2024-01-02 00:00:00.000");
    let tags = vec!["a".to_string(), "b".to_string()];

    let before = store.query_count();
    let rows = tag_set(&store, "env_a", &tags, floor, 1000).await;
    // The set's one query, after the planner's estimates of the window and of its matches
    // (src/store/tag_plan.rs), which are kept for the filter's next read.
    assert_eq!(store.query_count() - before, 3);
    assert_eq!(
        rows,
        vec!["ab_tie_y", "ab_tie_x", "abc", "at_floor"],
        "createdAt DESC, id DESC; floor inclusive"
    );

    let before = store.query_count();
    let rows = tag_set(&store, "env_a", &tags, floor, 2).await;
    assert_eq!(rows, vec!["ab_tie_y", "ab_tie_x"]);
    assert_eq!(store.query_count() - before, 1, "the estimates are kept");

    // No tags: every run of the env (including NULL runTags) above the floor.
    let rows = tag_set(&store, "env_a", &[], floor, 1000).await;
    assert_eq!(
        rows,
        vec!["untagged", "ab_tie_y", "ab_tie_x", "abc", "only_a", "at_floor"]
    );

    let unknown_tag = tag_set(&store, "env_a", &["zzz".to_string()], 0, 1000).await;
    assert!(unknown_tag.is_empty());
    db.cleanup().await;
}

/// When the planner estimates that the tags match at least the cap in a small window, the set
/// is read by the ordered scan of the environment's `(runtimeEnvironmentId, createdAt)` range
/// (src/store/tag_plan.rs): the same runs, order, floor and cap as the plain statement. On
/// this table of a few rows, every estimate is the planner's floor of one row, so a cap of one
/// takes the ordered scan and a larger cap the plain statement.
#[tokio::test]
async fn a_tag_set_read_by_the_ordered_scan_has_the_plain_statements_runs() {
    let db = TestDb::create().await;
    let ab: &[&str] = &["a", "b"];
    runs_at(
        &db.pool,
        "env_a",
        &[
            ("old", "2024-01-01 00:00:00.000", Some(ab)),
            ("only_a", "2024-01-03 00:00:00.000", Some(&["a"])),
            ("ab_x", "2024-01-05 00:00:00.000", Some(ab)),
            ("ab_y", "2024-01-05 00:00:00.000", Some(&["b", "a"])),
            ("newest_only_b", "2024-01-06 00:00:00.000", Some(&["b"])),
        ],
    )
    .await;
    runs_at(
        &db.pool,
        "env_b",
        &[("other_env", "2024-01-07 00:00:00.000", Some(ab))],
    )
    .await;
    let store = db.store();
    let floor = ms("2024-01-02 00:00:00.000");
    let tags = vec!["a".to_string(), "b".to_string()];
    let plans = |store: &PgStore| store.tag_plan_counts().map(|(_, n)| n);

    let [planner, ordered] = plans(&store);
    assert_eq!(
        tag_set(&store, "env_a", &tags, floor, 1).await,
        vec!["ab_y"]
    );
    assert_eq!(
        plans(&store),
        [planner, ordered + 1],
        "a cap of one: the ordered scan"
    );
    assert_eq!(
        tag_set(&store, "env_a", &tags, floor, 1000).await,
        vec!["ab_y", "ab_x"]
    );
    assert_eq!(
        plans(&store),
        [planner + 1, ordered + 1],
        "a large cap: the planner"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn resolve_batch_set_uses_internal_batch_id_env_scoped_newest_first() {
    let db = db_with_batch("bi_1", "batch_one").await;
    let p = &db.pool;
    for run in [
        ("r1", "env_a", "2024-01-01 00:00:00.001"),
        ("r2", "env_a", "2024-01-01 00:00:00.003"),
        ("r3", "env_a", "2024-01-01 00:00:00.002"),
        ("x", "env_b", "2024-01-01 00:00:00.000"),
    ] {
        batch_run_at(p, run, None, Some("bi_1")).await;
    }
    run_at(p, "loose", "env_a", "2024-01-01 00:00:00.000", None).await;
    let store = db.store();
    assert_eq!(
        batch_set(&store, "env_a", "bi_1", 1000).await,
        vec!["r2", "r3", "r1"]
    );
    assert_eq!(batch_set(&store, "env_a", "bi_1", 1).await, vec!["r2"]);
    assert!(batch_set(&store, "env_a", "batch_one", 10).await.is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn find_run_returns_batch_friendly_id_and_find_batch_is_env_scoped() {
    let db = db_with_batch("bi_1", "batch_one").await;
    let r1 = ("r1", "env_a", "2024-01-01 00:00:00.000");
    batch_run_at(&db.pool, r1, Some(&["x", "y"]), Some("bi_1")).await;
    run_at(&db.pool, "r2", "env_a", "2024-01-01 00:00:00.000", None).await;
    let store = db.store();

    let run = find_run(&store, "env_a", "run_r1").await.expect("found");
    assert_eq!(run.id, "r1");
    assert_eq!(run.friendly_id, "run_r1");
    assert_eq!(run.task_identifier, "my-task");
    assert_eq!(run.tags, vec!["x".to_string(), "y".to_string()]);
    assert_eq!(run.batch_friendly_id.as_deref(), Some("batch_one"));

    let run = find_run(&store, "env_a", "run_r2").await.expect("found");
    assert!(run.tags.is_empty(), "NULL runTags → []");
    assert_eq!(run.batch_friendly_id, None);

    let other_env = find_run(&store, "env_b", "run_r1").await;
    assert!(other_env.is_none(), "other env → not found");
    let internal = find_run(&store, "env_a", "r1").await;
    assert!(internal.is_none(), "internal id is not a friendly id");

    let batch = find_batch(&store, "env_a", "batch_one")
        .await
        .expect("found");
    assert_eq!(batch.id, "bi_1");
    assert_eq!(batch.friendly_id, "batch_one");
    assert!(find_batch(&store, "env_b", "batch_one").await.is_none());
    db.cleanup().await;
}

#[tokio::test]
async fn find_run_and_batch_fall_back_to_primary_on_replica_miss() {
    let primary = TestDb::create().await;
    let replica = TestDb::create().await; // Same schema, nothing replicated yet.
    insert_batch(&primary.pool, "bi_1", "batch_one", "env_a").await;
    run_at(
        &primary.pool,
        "r1",
        "env_a",
        "2024-01-01 00:00:00.000",
        None,
    )
    .await;
    let store = PgStore::from_pools(primary.pool.clone(), Some(replica.pool.clone()));

    let before = store.query_count();
    assert!(find_run(&store, "env_a", "run_r1").await.is_some());
    assert_eq!(
        store.query_count() - before,
        2,
        "replica miss, then primary"
    );
    assert!(find_batch(&store, "env_a", "batch_one").await.is_some());
    assert!(read_run(&store, "env_a", "r1").await.is_some());
    // Set reads are replica-only: nothing there yet.
    assert!(hydrate(&store, "env_a", &["r1"], ColumnSet::ALL)
        .await
        .is_empty());
    primary.cleanup().await;
    replica.cleanup().await;
}

#[tokio::test]
async fn timestamps_round_trip_to_the_exact_millisecond() {
    let db = TestDb::create().await;
    run_at(&db.pool, "r1", "env_a", "2024-05-06 07:08:09.123", None).await;
    sqlx::query(
        r#"UPDATE "TaskRun" SET "startedAt" = '1999-12-31 23:59:59.999', "completedAt" = '2030-01-01 00:00:00.001',
           "delayUntil" = NULL WHERE id = 'r1'"#,
    )
    .execute(&db.pool)
    .await
    .expect("update");
    let row = read_run(&db.store(), "env_a", "r1").await.expect("row");
    assert_eq!(row.created_at_ms, 1_714_979_289_123);
    assert_eq!(row.updated_at_ms, 1_714_979_289_130);
    assert_eq!(row.started_at_ms, Some(ms("1999-12-31 23:59:59.999")));
    assert_eq!(row.completed_at_ms, Some(ms("2030-01-01 00:00:00.001")));
    assert_eq!(row.delay_until_ms, None);
    db.cleanup().await;
}

#[tokio::test]
async fn error_jsonb_keeps_jsonb_key_order_and_serializes_compactly() {
    let db = TestDb::create().await;
    run_at(&db.pool, "r1", "env_a", "2024-01-01 00:00:00.000", None).await;
    run_at(&db.pool, "r2", "env_a", "2024-01-01 00:00:00.000", None).await;
    run_at(&db.pool, "r3", "env_a", "2024-01-01 00:00:00.000", None).await;
    sqlx::query(r#"UPDATE "TaskRun" SET error = '{"type": "STRING_ERROR", "raw": "boom"}'::jsonb WHERE id = 'r1'"#)
        .execute(&db.pool)
        .await
        .expect("r1");
    sqlx::query(
        r#"UPDATE "TaskRun" SET error = '{"type":"BUILT_IN_ERROR","name":"Error","message":"a, b: c","stackTrace":"at x"}'::jsonb
           WHERE id = 'r2'"#,
    )
    .execute(&db.pool)
    .await
    .expect("r2");
    sqlx::query(r#"UPDATE "TaskRun" SET error = 'null'::jsonb WHERE id = 'r3'"#)
        .execute(&db.pool)
        .await
        .expect("r3");
    let pg_text: String =
        sqlx::query_scalar(r#"SELECT error::text FROM "TaskRun" WHERE id = 'r1'"#)
            .fetch_one(&db.pool)
            .await
            .expect("text");
    assert_eq!(pg_text, r#"{"raw": "boom", "type": "STRING_ERROR"}"#);

    let rows = hydrate(&db.store(), "env_a", &["r1", "r2", "r3"], ColumnSet::ALL).await;
    let by_id = |id: &str| rows.iter().find(|r| r.id == id).expect("row").clone();
    let e1 = by_id("r1").error.expect("error");
    assert_eq!(
        serde_json::to_string(&e1).expect("json"),
        r#"{"raw":"boom","type":"STRING_ERROR"}"#
    );
    let e2 = by_id("r2").error.expect("error");
    assert_eq!(
        serde_json::to_string(&e2).expect("json"),
        r#"{"name":"Error","type":"BUILT_IN_ERROR","message":"a, b: c","stackTrace":"at x"}"#
    );
    assert_eq!(
        by_id("r3").error,
        None,
        "JSON null reads as null, as Prisma does"
    );
    db.cleanup().await;
}

// ------------------------------------------------------------------------------------------------
// EnvStore + Authenticator
// ------------------------------------------------------------------------------------------------

const PROD_KEY: &str = "tr_prod_abcdefghijklmnopqrstuvwx";
const OLD_KEY: &str = "tr_prod_OLDOLDOLDOLDOLDOLDOLDOLDOL";
const EXPIRED_KEY: &str = "tr_prod_EXPEXPEXPEXPEXPEXPEXPEXPEX";

async fn revoke(pool: &PgPool, id: &str, env: &str, key: &str, expires_in: &str) {
    let sql = r#"INSERT INTO "RevokedApiKey" (id, "apiKey", "runtimeEnvironmentId", "expiresAt")
           VALUES ($1, $2, $3, (now() AT TIME ZONE 'UTC') + $4::interval)"#;
    execute(pool, "revoke", sql, &[id, key, env, expires_in]).await;
}

/// The PRODUCTION environment `env_p` (see [`prod_env`]) with two revoked keys: [`OLD_KEY`],
/// still valid for `grace`, and [`EXPIRED_KEY`], whose grace ended `ended` ago.
async fn prod_env_with_revoked_keys(db: &TestDb, grace: &str, ended: &str) {
    prod_env(db).await;
    revoke(&db.pool, "rk1", "env_p", OLD_KEY, grace).await;
    revoke(&db.pool, "rk2", "env_p", EXPIRED_KEY, &format!("-{ended}")).await;
}

/// The id of the environment `Bearer <token>` authenticates as.
async fn env_of(auth: &Authenticator, token: &str, branch: Option<&str>) -> String {
    let principal = authenticate(auth, token, branch).await;
    principal.expect("authenticated").env.id.to_string()
}

/// Organization + project "a" with the PRODUCTION environment `env_p` (key [`PROD_KEY`]):
/// `(org, project)`.
async fn prod_env(db: &TestDb) -> (String, String) {
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    (org, project)
}

/// [`prod_env`] and an authenticator over the database.
async fn prod_auth(db: &TestDb) -> Authenticator {
    prod_env(db).await;
    authenticator(db)
}

const PARENT_KEY: &str = "tr_preview_parentparentparentparent";

/// Organization + project "a" with the PREVIEW environment `env_parent` (key [`PARENT_KEY`])
/// and its branch environments `(id, key, branch, archived)`: `(org, project)`.
async fn preview_envs(db: &TestDb, branches: &[(&str, &str, &str, bool)]) -> (String, String) {
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(
        &db.pool,
        &org,
        &project,
        "env_parent",
        "PREVIEW",
        PARENT_KEY,
    )
    .await;
    for &(id, api_key, branch, archived) in branches {
        let env = EnvFixture {
            id,
            env_type: "PREVIEW",
            api_key,
            parent: Some("env_parent"),
            branch: Some(branch),
            archived,
        };
        insert_env(&db.pool, &org, &project, env).await;
    }
    (org, project)
}

/// Authenticates `Bearer <token>` (with the `x-trigger-branch` value `branch`).
async fn authenticate(
    auth: &Authenticator,
    token: &str,
    branch: Option<&str>,
) -> Result<runfeed::auth::Principal, AuthError> {
    auth.authenticate(Some(&bearer(token)), branch).await
}

/// Authenticating `Bearer <token>` fails with an error of `want`'s kind; returns the error.
async fn refused(
    auth: &Authenticator,
    token: &str,
    branch: Option<&str>,
    want: AuthError,
) -> AuthError {
    let err = authenticate(auth, token, branch)
        .await
        .expect_err("authentication must fail");
    let same = std::mem::discriminant(&err) == std::mem::discriminant(&want);
    assert!(same, "{token:?}: {err:?}, want {want:?}");
    err
}

/// A public access token for environment `sub` (the default [`claims`]) signed with `key`.
fn jwt(sub: &str, key: &str) -> String {
    sign(&claims(sub), key)
}

fn authenticator(db: &TestDb) -> Authenticator {
    Authenticator::new(Arc::new(db.store()), Duration::ZERO)
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn now_s() -> i64 {
    chrono::Utc::now().timestamp()
}

fn sign(claims: &Value, key: &str) -> String {
    let mut header = Header::new(Algorithm::HS256);
    header.typ = None;
    jsonwebtoken::encode(
        &header,
        claims,
        &EncodingKey::from_secret(key.as_bytes()).expect("key"),
    )
    .expect("sign")
}

fn claims(sub: &str) -> Value {
    json!({
        "pub": true,
        "sub": sub,
        "scopes": ["read:runs:run_1"],
        "iss": "https://id.trigger.dev",
        "aud": "https://api.trigger.dev",
        "iat": now_s(),
        "exp": now_s() + 900,
    })
}

#[tokio::test]
async fn secret_key_authenticates_with_full_ability() {
    let db = TestDb::create().await;
    let (org, project) = prod_env(&db).await;
    let auth = authenticator(&db);
    let p = authenticate(&auth, PROD_KEY, None).await.expect("auth");
    assert_eq!(p.env.id, "env_p");
    assert_eq!(p.env.organization_id, org);
    assert_eq!(p.env.project_id, project);
    assert_eq!(p.env.env_type, "PRODUCTION");
    assert_eq!(p.ability, Ability::All);
    let err = refused(&auth, "tr_prod_unknown", None, AuthError::InvalidApiKey).await;
    assert_eq!(err.to_string(), "Invalid API key");
    db.cleanup().await;
}

#[tokio::test]
async fn revoked_key_works_within_grace_and_not_after_expiry() {
    let db = TestDb::create().await;
    // 30 minutes either side: a session-time-zone mistake (fixture runs at +05:30) would flip these.
    prod_env_with_revoked_keys(&db, "30 minutes", "30 minutes").await;
    let store = db.store();
    let by_old = store.env_by_revoked_key(OLD_KEY).await.expect("lookup");
    assert_eq!(by_old.map(|e| e.id).as_deref(), Some("env_p"));
    let by_expired = store.env_by_revoked_key(EXPIRED_KEY).await.expect("lookup");
    assert!(by_expired.is_none());
    let keys = store.revoked_keys(&env_id("env_p")).await.expect("keys");
    assert_eq!(keys, vec![OLD_KEY.to_string()]);

    let auth = authenticator(&db);
    assert_eq!(env_of(&auth, OLD_KEY, None).await, "env_p");
    refused(&auth, EXPIRED_KEY, None, AuthError::InvalidApiKey).await;
    db.cleanup().await;
}

#[tokio::test]
async fn deleted_project_rejects_secret_key_and_public_token() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "d", true).await;
    simple_env(&db.pool, &org, &project, "env_d", "PRODUCTION", PROD_KEY).await;
    let auth = authenticator(&db);
    refused(&auth, PROD_KEY, None, AuthError::InvalidApiKey).await;
    let token = jwt("env_d", PROD_KEY);
    let err = refused(&auth, &token, None, AuthError::PublicTokenEnvNotFound).await;
    assert_eq!(runfeed::http::ApiError::from(err).status().as_u16(), 401);
    db.cleanup().await;
}

#[tokio::test]
async fn public_token_valid_expired_bad_signature_wrong_iss_missing_aud() {
    let db = TestDb::create().await;
    let auth = prod_auth(&db).await;
    let batch_x = runfeed::auth::batch_route_resources("batch_x");

    let mut c = claims("env_p");
    c["realtime"] = json!({"skipColumns": ["payload"]});
    let p = authenticate(&auth, &sign(&c, PROD_KEY), Some("ignored"))
        .await
        .expect("valid");
    assert_eq!(p.env.id, "env_p");
    assert!(!p.ability.can_read_any(&batch_x));
    assert_eq!(p.ability, Ability::from_scopes(&["read:runs:run_1"]));
    assert_eq!(p.skip_columns, Some(vec!["payload".to_string()]));

    let scopes = ["read:all".to_string()];
    let ttl = Duration::from_secs(60);
    let minted = mint_public_token(PROD_KEY, "env_p", &scopes, ttl, None).expect("mint");
    let p = authenticate(&auth, &minted, None).await.expect("minted");
    assert_eq!(p.skip_columns, None);
    assert!(p.ability.can_read_any(&batch_x));

    let invalid = |edit: &dyn Fn(&mut Value), key: &str| {
        let mut c = claims("env_p");
        edit(&mut c);
        sign(&c, key)
    };
    let cases = [
        (
            "expired",
            invalid(&|c| c["exp"] = json!(now_s() - 1), PROD_KEY),
        ),
        (
            "bad signature",
            invalid(&|_| {}, "tr_prod_wrongwrongwrongwrongwrong"),
        ),
        (
            "wrong iss",
            invalid(&|c| c["iss"] = json!("https://evil.example"), PROD_KEY),
        ),
        (
            "missing aud",
            invalid(
                &|c| {
                    c.as_object_mut().expect("obj").remove("aud");
                },
                PROD_KEY,
            ),
        ),
    ];
    for (what, token) in cases {
        let err = refused(&auth, &token, None, AuthError::InvalidPublicToken).await;
        assert_eq!(err.to_string(), "Public Access Token is invalid", "{what}");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn jwt_without_pub_true_takes_the_api_key_path() {
    let db = TestDb::create().await;
    let auth = prod_auth(&db).await;
    let mut c = claims("env_p");
    c.as_object_mut().expect("obj").remove("pub");
    let err = refused(&auth, &sign(&c, PROD_KEY), None, AuthError::InvalidApiKey).await;
    assert_eq!(err.to_string(), "Invalid API key");
    db.cleanup().await;
}

#[tokio::test]
async fn branch_env_public_token_verifies_with_the_parent_key() {
    let db = TestDb::create().await;
    let child_key = "tr_preview_childchildchildchildchi";
    preview_envs(&db, &[("env_child", child_key, "feat-x", false)]).await;
    let store = db.store();
    let child = store
        .env_by_id(&env_id("env_child"))
        .await
        .expect("lookup")
        .expect("child");
    assert_eq!(child.parent_api_key.as_deref(), Some(PARENT_KEY));
    assert_eq!(child.branch_name.as_deref(), Some("feat-x"));

    let auth = authenticator(&db);
    let signed_by_parent = jwt("env_child", PARENT_KEY);
    assert_eq!(env_of(&auth, &signed_by_parent, None).await, "env_child");
    let signed_by_child = jwt("env_child", child_key);
    refused(&auth, &signed_by_child, None, AuthError::InvalidPublicToken).await;
    db.cleanup().await;
}

#[tokio::test]
async fn public_token_signed_with_a_revoked_key_verifies_during_grace_only() {
    let db = TestDb::create().await;
    prod_env_with_revoked_keys(&db, "1 hour", "1 minute").await;
    let auth = authenticator(&db);
    assert_eq!(env_of(&auth, &jwt("env_p", OLD_KEY), None).await, "env_p");
    let expired_key = jwt("env_p", EXPIRED_KEY);
    refused(&auth, &expired_key, None, AuthError::InvalidPublicToken).await;
    // Only a signature failure is retried: an expired token signed with the revoked key stays invalid.
    let mut c = claims("env_p");
    c["exp"] = json!(now_s() - 10);
    let expired_token = sign(&c, OLD_KEY);
    refused(&auth, &expired_token, None, AuthError::InvalidPublicToken).await;
    db.cleanup().await;
}

#[tokio::test]
async fn preview_secret_key_requires_branch_header_and_pivots_to_the_child() {
    let db = TestDb::create().await;
    let branches = [
        ("env_child", "tr_preview_c1", "feat-x", false),
        ("env_gone", "tr_preview_c2", "old", true),
    ];
    let (_, project) = preview_envs(&db, &branches).await;
    let auth = authenticator(&db);
    let err = refused(&auth, PARENT_KEY, None, AuthError::BranchRequired).await;
    assert_eq!(
        err.to_string(),
        "x-trigger-branch header required for preview env"
    );

    let p = authenticate(&auth, PARENT_KEY, Some("refs/heads/feat-x"))
        .await
        .expect("branch");
    assert_eq!(p.env.id, "env_child");
    assert_eq!(p.env.env_type, "PREVIEW");
    assert_eq!(p.env.project_id, project);

    refused(&auth, PARENT_KEY, Some("old"), AuthError::NoMatchingBranch).await;
    let err = authenticate(&auth, PARENT_KEY, Some("nope"))
        .await
        .expect_err("unknown");
    assert_eq!(err.to_string(), "No matching branch env");
    db.cleanup().await;
}

#[tokio::test]
async fn missing_or_empty_bearer_is_invalid_or_missing_api_key() {
    let db = TestDb::create().await;
    let auth = authenticator(&db);
    for header in [None, Some(""), Some("Bearer "), Some("Bearer    ")] {
        let err = auth.authenticate(header, None).await.expect_err("missing");
        assert!(matches!(err, AuthError::Missing));
        assert_eq!(err.to_string(), "Invalid or Missing API key");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn connect_lazy_with_applies_statement_timeout_and_ping_counts_queries() {
    let db = TestDb::create().await;
    let store = PgStore::connect_lazy_with(&db.url, Some(&db.url), 2, 5_000, false).expect("store");
    store.ping().await.expect("ping");
    assert_eq!(
        store.query_count(),
        1,
        "same URL → one pool, one ping query"
    );
    let timeout: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(store.primary())
        .await
        .expect("show");
    assert_eq!(timeout, "5s");
    assert!(PgStore::connect_lazy("not a url", None).is_err());
    db.cleanup().await;
}
