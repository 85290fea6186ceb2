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

async fn insert_batch(pool: &PgPool, id: &str, friendly_id: &str, env: &str) {
    sqlx::query(
        r#"INSERT INTO "BatchTaskRun" (id, "friendlyId", "runtimeEnvironmentId", "updatedAt") VALUES ($1, $2, $3, now())"#,
    )
    .bind(id)
    .bind(friendly_id)
    .bind(env)
    .execute(pool)
    .await
    .expect("batch");
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
    insert_run(
        pool,
        RunFixture {
            id,
            env,
            created_at,
            tags,
            batch: None,
        },
    )
    .await;
}

fn ids(rows: &[runfeed::protocol::RunRow]) -> Vec<String> {
    rows.iter().map(|r| r.id.to_string()).collect()
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
    let set = |cols: &[&str]| cols.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        not_null_no_default("TaskRun").await,
        set(&[
            "id",
            "payload",
            "runtimeEnvironmentId",
            "projectId",
            "updatedAt",
            "taskIdentifier",
            "friendlyId",
            "spanId",
            "traceId",
            "queue"
        ])
    );
    assert_eq!(
        not_null_no_default("RuntimeEnvironment").await,
        set(&[
            "id",
            "slug",
            "apiKey",
            "organizationId",
            "updatedAt",
            "projectId",
            "pkApiKey",
            "shortcode"
        ])
    );
    assert_eq!(
        not_null_no_default("BatchTaskRun").await,
        set(&["id", "friendlyId", "runtimeEnvironmentId", "updatedAt"])
    );
    assert_eq!(
        not_null_no_default("Organization").await,
        set(&["id", "slug", "title", "updatedAt"])
    );
    assert_eq!(
        not_null_no_default("Project").await,
        set(&[
            "id",
            "name",
            "organizationId",
            "updatedAt",
            "slug",
            "externalRef"
        ])
    );

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

    let store = db.store();
    let before = store.query_count();
    let rows = store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_a"),
            &wanted
                .iter()
                .map(|w| runfeed::protocol::RunId::from(w.as_str()))
                .collect::<Vec<_>>(),
            ColumnSet::ALL,
        )
        .await
        .expect("hydrate");
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
    assert!(store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_a"),
            &[],
            ColumnSet::ALL
        )
        .await
        .expect("empty")
        .is_empty());
    assert_eq!(store.query_count(), before, "no ids → no query");

    let rows = store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_b"),
            &["a00".to_string().into()],
            ColumnSet::ALL,
        )
        .await
        .expect("hydrate b");
    assert!(rows.is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn hydrate_projection_skips_columns_but_keeps_router_columns() {
    let db = TestDb::create().await;
    insert_batch(&db.pool, "batch_internal", "batch_friendly", "env_a").await;
    insert_run(
        &db.pool,
        RunFixture {
            id: "r1",
            env: "env_a",
            created_at: "2024-02-03 04:05:06.789",
            tags: Some(&["t1"]),
            batch: Some("batch_internal"),
        },
    )
    .await;
    sqlx::query(r#"UPDATE "TaskRun" SET output = 'out', metadata = 'meta' WHERE id = 'r1'"#)
        .execute(&db.pool)
        .await
        .expect("update");
    let store = db.store();

    let cols = ColumnSet::from_skip_list(&["payload", "output", "runTags", "updatedAt"]);
    let row = store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_a"),
            &["r1".to_string().into()],
            cols,
        )
        .await
        .expect("hydrate")
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

    let full = store
        .read_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::RunId::from("r1"),
            ColumnSet::ALL,
        )
        .await
        .expect("read")
        .expect("found");
    assert_eq!(full.payload, r#"{"n":1}"#);
    assert_eq!(full.output.as_deref(), Some("out"));
    assert_eq!(full.realtime_streams, Some(vec![]));
    assert!(store
        .read_run(
            &runfeed::protocol::EnvId::from("env_b"),
            &runfeed::protocol::RunId::from("r1"),
            ColumnSet::ALL
        )
        .await
        .expect("read")
        .is_none());
    assert!(store
        .read_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::RunId::from("nope"),
            ColumnSet::ALL
        )
        .await
        .expect("read")
        .is_none());
    db.cleanup().await;
}

#[tokio::test]
async fn resolve_tag_set_contains_all_tags_respects_floor_newest_first_and_cap() {
    let db = TestDb::create().await;
    let p = &db.pool;
    run_at(
        p,
        "old",
        "env_a",
        "2024-01-01 00:00:00.000",
        Some(&["a", "b"]),
    )
    .await;
    run_at(
        p,
        "at_floor",
        "env_a",
        "2024-01-02 00:00:00.000",
        Some(&["a", "b"]),
    )
    .await;
    run_at(
        p,
        "only_a",
        "env_a",
        "2024-01-03 00:00:00.000",
        Some(&["a"]),
    )
    .await;
    run_at(
        p,
        "abc",
        "env_a",
        "2024-01-04 00:00:00.000",
        Some(&["c", "b", "a"]),
    )
    .await;
    run_at(
        p,
        "ab_tie_x",
        "env_a",
        "2024-01-05 00:00:00.000",
        Some(&["a", "b"]),
    )
    .await;
    run_at(
        p,
        "ab_tie_y",
        "env_a",
        "2024-01-05 00:00:00.000",
        Some(&["b", "a"]),
    )
    .await;
    run_at(p, "untagged", "env_a", "2024-01-06 00:00:00.000", None).await;
    run_at(
        p,
        "other_env",
        "env_b",
        "2024-01-06 00:00:00.000",
        Some(&["a", "b"]),
    )
    .await;
    let store = db.store();
    let floor = ms("2024-01-02 00:00:00.000");
    let tags = vec!["a".to_string(), "b".to_string()];

    let before = store.query_count();
    let rows = store
        .resolve_tag_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &tags,
            floor,
            1000,
            ColumnSet::ALL,
        )
        .await
        .expect("resolve");
    assert_eq!(store.query_count() - before, 1);
    assert_eq!(
        ids(&rows),
        vec!["ab_tie_y", "ab_tie_x", "abc", "at_floor"],
        "createdAt DESC, id DESC; floor inclusive"
    );

    let rows = store
        .resolve_tag_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &tags,
            floor,
            2,
            ColumnSet::ALL,
        )
        .await
        .expect("cap");
    assert_eq!(ids(&rows), vec!["ab_tie_y", "ab_tie_x"]);

    // No tags: every run of the env (including NULL runTags) above the floor.
    let rows = store
        .resolve_tag_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &[],
            floor,
            1000,
            ColumnSet::ALL,
        )
        .await
        .expect("all");
    assert_eq!(
        ids(&rows),
        vec!["untagged", "ab_tie_y", "ab_tie_x", "abc", "only_a", "at_floor"]
    );

    let rows = store
        .resolve_tag_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &["zzz".to_string()],
            0,
            1000,
            ColumnSet::ALL,
        )
        .await
        .expect("none");
    assert!(rows.is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn resolve_batch_set_uses_internal_batch_id_env_scoped_newest_first() {
    let db = TestDb::create().await;
    let p = &db.pool;
    insert_batch(p, "bi_1", "batch_one", "env_a").await;
    for (id, at) in [
        ("r1", "2024-01-01 00:00:00.001"),
        ("r2", "2024-01-01 00:00:00.003"),
        ("r3", "2024-01-01 00:00:00.002"),
    ] {
        insert_run(
            p,
            RunFixture {
                id,
                env: "env_a",
                created_at: at,
                tags: None,
                batch: Some("bi_1"),
            },
        )
        .await;
    }
    insert_run(
        p,
        RunFixture {
            id: "x",
            env: "env_b",
            created_at: "2024-01-01 00:00:00.000",
            tags: None,
            batch: Some("bi_1"),
        },
    )
    .await;
    run_at(p, "loose", "env_a", "2024-01-01 00:00:00.000", None).await;
    let store = db.store();
    let rows = store
        .resolve_batch_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::BatchId::from("bi_1"),
            1000,
            ColumnSet::ALL,
        )
        .await
        .expect("batch");
    assert_eq!(ids(&rows), vec!["r2", "r3", "r1"]);
    let rows = store
        .resolve_batch_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::BatchId::from("bi_1"),
            1,
            ColumnSet::ALL,
        )
        .await
        .expect("cap");
    assert_eq!(ids(&rows), vec!["r2"]);
    assert!(store
        .resolve_batch_set(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::BatchId::from("batch_one"),
            10,
            ColumnSet::ALL
        )
        .await
        .expect("friendly")
        .is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn find_run_returns_batch_friendly_id_and_find_batch_is_env_scoped() {
    let db = TestDb::create().await;
    let p = &db.pool;
    insert_batch(p, "bi_1", "batch_one", "env_a").await;
    insert_run(
        p,
        RunFixture {
            id: "r1",
            env: "env_a",
            created_at: "2024-01-01 00:00:00.000",
            tags: Some(&["x", "y"]),
            batch: Some("bi_1"),
        },
    )
    .await;
    run_at(p, "r2", "env_a", "2024-01-01 00:00:00.000", None).await;
    let store = db.store();

    let run = store
        .find_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::FriendlyRunId::from("run_r1"),
        )
        .await
        .expect("find")
        .expect("found");
    assert_eq!(run.id, "r1");
    assert_eq!(run.friendly_id, "run_r1");
    assert_eq!(run.task_identifier, "my-task");
    assert_eq!(run.tags, vec!["x".to_string(), "y".to_string()]);
    assert_eq!(run.batch_friendly_id.as_deref(), Some("batch_one"));

    let run = store
        .find_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::FriendlyRunId::from("run_r2"),
        )
        .await
        .expect("find")
        .expect("found");
    assert!(run.tags.is_empty(), "NULL runTags → []");
    assert_eq!(run.batch_friendly_id, None);

    assert!(
        store
            .find_run(
                &runfeed::protocol::EnvId::from("env_b"),
                &runfeed::protocol::FriendlyRunId::from("run_r1")
            )
            .await
            .expect("find")
            .is_none(),
        "other env → not found"
    );
    assert!(
        store
            .find_run(
                &runfeed::protocol::EnvId::from("env_a"),
                &runfeed::protocol::FriendlyRunId::from("r1")
            )
            .await
            .expect("find")
            .is_none(),
        "internal id is not a friendly id"
    );

    let batch = store
        .find_batch(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::FriendlyBatchId::from("batch_one"),
        )
        .await
        .expect("batch")
        .expect("found");
    assert_eq!(batch.id, "bi_1");
    assert_eq!(batch.friendly_id, "batch_one");
    assert!(store
        .find_batch(
            &runfeed::protocol::EnvId::from("env_b"),
            &runfeed::protocol::FriendlyBatchId::from("batch_one")
        )
        .await
        .expect("batch")
        .is_none());
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
    assert!(store
        .find_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::FriendlyRunId::from("run_r1")
        )
        .await
        .expect("find")
        .is_some());
    assert_eq!(
        store.query_count() - before,
        2,
        "replica miss, then primary"
    );
    assert!(store
        .find_batch(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::FriendlyBatchId::from("batch_one")
        )
        .await
        .expect("find")
        .is_some());
    assert!(store
        .read_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::RunId::from("r1"),
            ColumnSet::ALL
        )
        .await
        .expect("read")
        .is_some());
    // Set reads are replica-only: nothing there yet.
    assert!(store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_a"),
            &["r1".to_string().into()],
            ColumnSet::ALL
        )
        .await
        .expect("hydrate")
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
    let store = db.store();
    let row = store
        .read_run(
            &runfeed::protocol::EnvId::from("env_a"),
            &runfeed::protocol::RunId::from("r1"),
            ColumnSet::ALL,
        )
        .await
        .expect("read")
        .expect("row");
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

    let store = db.store();
    let rows = store
        .hydrate(
            &runfeed::protocol::EnvId::from("env_a"),
            &[
                "r1".to_string().into(),
                "r2".to_string().into(),
                "r3".to_string().into(),
            ],
            ColumnSet::ALL,
        )
        .await
        .expect("hydrate");
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
    sqlx::query(
        r#"INSERT INTO "RevokedApiKey" (id, "apiKey", "runtimeEnvironmentId", "expiresAt")
           VALUES ($1, $2, $3, (now() AT TIME ZONE 'UTC') + $4::interval)"#,
    )
    .bind(id)
    .bind(key)
    .bind(env)
    .bind(expires_in)
    .execute(pool)
    .await
    .expect("revoke");
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
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    let auth = authenticator(&db);
    let p = auth
        .authenticate(Some(&bearer(PROD_KEY)), None)
        .await
        .expect("auth");
    assert_eq!(p.env.id, "env_p");
    assert_eq!(p.env.organization_id, org);
    assert_eq!(p.env.project_id, project);
    assert_eq!(p.env.env_type, "PRODUCTION");
    assert_eq!(p.ability, Ability::All);
    let err = auth
        .authenticate(Some(&bearer("tr_prod_unknown")), None)
        .await
        .expect_err("unknown");
    assert!(matches!(err, AuthError::InvalidApiKey));
    assert_eq!(err.to_string(), "Invalid API key");
    db.cleanup().await;
}

#[tokio::test]
async fn revoked_key_works_within_grace_and_not_after_expiry() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    // 30 minutes either side: a session-time-zone mistake (fixture runs at +05:30) would flip these.
    revoke(&db.pool, "rk1", "env_p", OLD_KEY, "30 minutes").await;
    revoke(&db.pool, "rk2", "env_p", EXPIRED_KEY, "-30 minutes").await;
    let store = db.store();
    assert_eq!(
        store
            .env_by_revoked_key(OLD_KEY)
            .await
            .expect("lookup")
            .map(|e| e.id)
            .as_deref(),
        Some("env_p")
    );
    assert!(store
        .env_by_revoked_key(EXPIRED_KEY)
        .await
        .expect("lookup")
        .is_none());
    assert_eq!(
        store
            .revoked_keys(&runfeed::protocol::EnvId::from("env_p"))
            .await
            .expect("keys"),
        vec![OLD_KEY.to_string()]
    );

    let auth = authenticator(&db);
    let p = auth
        .authenticate(Some(&bearer(OLD_KEY)), None)
        .await
        .expect("grace");
    assert_eq!(p.env.id, "env_p");
    assert!(matches!(
        auth.authenticate(Some(&bearer(EXPIRED_KEY)), None).await,
        Err(AuthError::InvalidApiKey)
    ));
    db.cleanup().await;
}

#[tokio::test]
async fn deleted_project_rejects_secret_key_and_public_token() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "d", true).await;
    simple_env(&db.pool, &org, &project, "env_d", "PRODUCTION", PROD_KEY).await;
    let auth = authenticator(&db);
    assert!(matches!(
        auth.authenticate(Some(&bearer(PROD_KEY)), None).await,
        Err(AuthError::InvalidApiKey)
    ));
    let token = sign(&claims("env_d"), PROD_KEY);
    let err = auth
        .authenticate(Some(&bearer(&token)), None)
        .await
        .expect_err("deleted");
    assert!(matches!(err, AuthError::PublicTokenEnvNotFound));
    assert_eq!(runfeed::http::ApiError::from(err).status().as_u16(), 401);
    db.cleanup().await;
}

#[tokio::test]
async fn public_token_valid_expired_bad_signature_wrong_iss_missing_aud() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    let auth = authenticator(&db);

    let mut c = claims("env_p");
    c["realtime"] = json!({"skipColumns": ["payload"]});
    let p = auth
        .authenticate(Some(&bearer(&sign(&c, PROD_KEY))), Some("ignored"))
        .await
        .expect("valid");
    assert_eq!(p.env.id, "env_p");
    assert!(!p
        .ability
        .can_read_any(&runfeed::auth::batch_route_resources("batch_x")));
    assert_eq!(p.ability, Ability::from_scopes(&["read:runs:run_1"]));
    assert_eq!(p.skip_columns, Some(vec!["payload".to_string()]));

    let minted = mint_public_token(
        PROD_KEY,
        "env_p",
        &["read:all".to_string()],
        Duration::from_secs(60),
        None,
    )
    .expect("mint");
    let p = auth
        .authenticate(Some(&bearer(&minted)), None)
        .await
        .expect("minted");
    assert_eq!(p.skip_columns, None);
    assert!(p
        .ability
        .can_read_any(&runfeed::auth::batch_route_resources("batch_x")));

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
        let err = auth
            .authenticate(Some(&bearer(&token)), None)
            .await
            .expect_err(what);
        assert!(
            matches!(err, AuthError::InvalidPublicToken),
            "{what}: {err:?}"
        );
        assert_eq!(err.to_string(), "Public Access Token is invalid");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn jwt_without_pub_true_takes_the_api_key_path() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    let auth = authenticator(&db);
    let mut c = claims("env_p");
    c.as_object_mut().expect("obj").remove("pub");
    let err = auth
        .authenticate(Some(&bearer(&sign(&c, PROD_KEY))), None)
        .await
        .expect_err("no pub");
    assert!(matches!(err, AuthError::InvalidApiKey));
    assert_eq!(err.to_string(), "Invalid API key");
    db.cleanup().await;
}

#[tokio::test]
async fn branch_env_public_token_verifies_with_the_parent_key() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    let parent_key = "tr_preview_parentparentparentparent";
    let child_key = "tr_preview_childchildchildchildchi";
    simple_env(
        &db.pool,
        &org,
        &project,
        "env_parent",
        "PREVIEW",
        parent_key,
    )
    .await;
    insert_env(
        &db.pool,
        &org,
        &project,
        EnvFixture {
            id: "env_child",
            env_type: "PREVIEW",
            api_key: child_key,
            parent: Some("env_parent"),
            branch: Some("feat-x"),
            archived: false,
        },
    )
    .await;
    let store = db.store();
    let child = store
        .env_by_id(&runfeed::protocol::EnvId::from("env_child"))
        .await
        .expect("lookup")
        .expect("child");
    assert_eq!(child.parent_api_key.as_deref(), Some(parent_key));
    assert_eq!(child.branch_name.as_deref(), Some("feat-x"));

    let auth = authenticator(&db);
    let p = auth
        .authenticate(Some(&bearer(&sign(&claims("env_child"), parent_key))), None)
        .await
        .expect("parent key");
    assert_eq!(p.env.id, "env_child");
    let err = auth
        .authenticate(Some(&bearer(&sign(&claims("env_child"), child_key))), None)
        .await
        .expect_err("child key");
    assert!(matches!(err, AuthError::InvalidPublicToken));
    db.cleanup().await;
}

#[tokio::test]
async fn public_token_signed_with_a_revoked_key_verifies_during_grace_only() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    simple_env(&db.pool, &org, &project, "env_p", "PRODUCTION", PROD_KEY).await;
    revoke(&db.pool, "rk1", "env_p", OLD_KEY, "1 hour").await;
    revoke(&db.pool, "rk2", "env_p", EXPIRED_KEY, "-1 minute").await;
    let auth = authenticator(&db);
    let p = auth
        .authenticate(Some(&bearer(&sign(&claims("env_p"), OLD_KEY))), None)
        .await
        .expect("grace retry");
    assert_eq!(p.env.id, "env_p");
    let err = auth
        .authenticate(Some(&bearer(&sign(&claims("env_p"), EXPIRED_KEY))), None)
        .await
        .expect_err("expired");
    assert!(matches!(err, AuthError::InvalidPublicToken));
    // Only a signature failure is retried: an expired token signed with the revoked key stays invalid.
    let mut c = claims("env_p");
    c["exp"] = json!(now_s() - 10);
    let err = auth
        .authenticate(Some(&bearer(&sign(&c, OLD_KEY))), None)
        .await
        .expect_err("expired token");
    assert!(matches!(err, AuthError::InvalidPublicToken));
    db.cleanup().await;
}

#[tokio::test]
async fn preview_secret_key_requires_branch_header_and_pivots_to_the_child() {
    let db = TestDb::create().await;
    let (org, project) = org_project(&db.pool, "a", false).await;
    let parent_key = "tr_preview_parentparentparentparent";
    simple_env(
        &db.pool,
        &org,
        &project,
        "env_parent",
        "PREVIEW",
        parent_key,
    )
    .await;
    insert_env(
        &db.pool,
        &org,
        &project,
        EnvFixture {
            id: "env_child",
            env_type: "PREVIEW",
            api_key: "tr_preview_c1",
            parent: Some("env_parent"),
            branch: Some("feat-x"),
            archived: false,
        },
    )
    .await;
    insert_env(
        &db.pool,
        &org,
        &project,
        EnvFixture {
            id: "env_gone",
            env_type: "PREVIEW",
            api_key: "tr_preview_c2",
            parent: Some("env_parent"),
            branch: Some("old"),
            archived: true,
        },
    )
    .await;
    let auth = authenticator(&db);
    let err = auth
        .authenticate(Some(&bearer(parent_key)), None)
        .await
        .expect_err("no branch");
    assert!(matches!(err, AuthError::BranchRequired));
    assert_eq!(
        err.to_string(),
        "x-trigger-branch header required for preview env"
    );

    let p = auth
        .authenticate(Some(&bearer(parent_key)), Some("refs/heads/feat-x"))
        .await
        .expect("branch");
    assert_eq!(p.env.id, "env_child");
    assert_eq!(p.env.env_type, "PREVIEW");
    assert_eq!(p.env.project_id, project);

    let err = auth
        .authenticate(Some(&bearer(parent_key)), Some("old"))
        .await
        .expect_err("archived");
    assert!(matches!(err, AuthError::NoMatchingBranch));
    let err = auth
        .authenticate(Some(&bearer(parent_key)), Some("nope"))
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
