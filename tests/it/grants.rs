//! The least-privilege database role (`deploy/trigger.dev/runfeed-role.sql`) and runfeed's own
//! check of it (`runfeed::store::grants`), against the local Postgres: the file grants exactly
//! what runfeed reads; every read runfeed issues works as that role (and nothing can be written);
//! a missing privilege is named by the check, stops `runfeed serve` at start, and turns `/readyz`
//! to 503 when it is revoked while running.
//!
//! The role file is applied with `psql` (it is a psql script: variables, `\gexec`), each test
//! with its own role name and database. `tests/e2e/80-db-role.test.mjs` follows every feed with the
//! real SDK through a server connected as the role.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::Duration;

use common::{tagged_in_batch, test_config, within, PG_ADMIN, REDIS_URL, WAIT};
use runfeed::protocol::{BatchId, ColumnSet, EnvId, FriendlyBatchId, FriendlyRunId, RunId};
use runfeed::store::grants::{self, GrantError, Missing, Server};
use runfeed::store::{EnvStore, PgStore, ReplicaProbe, RunResource, RunStore};
use runfeed_dev::fixtures::{self, TestDb};

const ROLE_SQL: &str = "deploy/trigger.dev/runfeed-role.sql";

fn role_sql() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/trigger.dev/runfeed-role.sql"
    ))
    .expect("reading the role file")
}

/// psql on the local server as the superuser, without ~/.psqlrc, quietly.
const PSQL_AS_SUPERUSER: [&str; 6] = ["-X", "-q", "-h", "127.0.0.1", "-U", "postgres"];

/// The error text of `query`, which must fail on `pool`.
async fn refused(
    pool: &sqlx::PgPool,
    what: &str,
    query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> String {
    query.execute(pool).await.expect_err(what).to_string()
}

/// A database with trigger.dev's tables and a role created by the role file.
struct RoleDb {
    db: Option<TestDb>,
    role: String,
}

impl RoleDb {
    async fn create() -> RoleDb {
        let db = within(WAIT, "create test database", TestDb::create(PG_ADMIN))
            .await
            .expect("create test database");
        let role = format!("runfeed_t_role_{}", fixtures::new_id());
        let me = RoleDb { db: Some(db), role };
        me.psql_file(ROLE_SQL).await;
        me
    }

    fn db(&self) -> &TestDb {
        self.db.as_ref().expect("database")
    }

    /// The database as the role (trust authentication on the local server).
    fn role_url(&self) -> String {
        format!("postgres://{}@127.0.0.1:5432/{}", self.role, self.db().name)
    }

    async fn psql(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = tokio::process::Command::new("psql");
        cmd.args(PSQL_AS_SUPERUSER)
            .args(["-d", &self.db().name])
            .args([
                "-v",
                "ON_ERROR_STOP=1",
                "-v",
                &format!("role={}", self.role),
            ])
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null());
        within(WAIT, "psql", cmd.output())
            .await
            .expect("running psql")
    }

    async fn psql_file(&self, file: &str) {
        let out = self.psql(&["-f", file]).await;
        assert!(
            out.status.success(),
            "psql -f {file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs SQL as the superuser (`:"role"` names the test's role).
    async fn admin(&self, sql: &str) {
        let out = self
            .psql(&[
                "-c",
                &sql.replace(":\"role\"", &format!("\"{}\"", self.role)),
            ])
            .await;
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    async fn cleanup(mut self) {
        if let Some(db) = self.db.take() {
            let _ = db.cleanup().await;
        }
    }
}

impl Drop for RoleDb {
    /// Drops the database (if a panicking test left it) and the role, with psql: a role outlives
    /// the test otherwise.
    fn drop(&mut self) {
        let mut cmd = std::process::Command::new("psql");
        cmd.args(PSQL_AS_SUPERUSER).args(["-d", "postgres"]);
        if let Some(db) = &self.db {
            cmd.args([
                "-c",
                &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", db.name),
            ]);
        }
        let _ = cmd
            .args(["-c", &format!("DROP ROLE IF EXISTS \"{}\"", self.role)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn missing(err: GrantError) -> (Server, String, Vec<Missing>) {
    match err {
        GrantError::Missing {
            server,
            role,
            missing,
        } => (server, role, missing),
        other => panic!("expected missing grants, got {other}"),
    }
}

// ---------------------------------------------------------------------------------------------

/// `table → columns` of every `GRANT SELECT (…) ON :"schema"."Table"` in the role file.
fn granted_columns(sql: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for part in sql.split("GRANT SELECT (").skip(1) {
        let (cols, rest) = part.split_once(')').expect("column list");
        let table = rest
            .trim_start()
            .strip_prefix("ON :\"schema\".\"")
            .and_then(|r| r.split_once('"'))
            .map(|(t, _)| t.to_string())
            .expect("ON :\"schema\".\"Table\"");
        let cols: BTreeSet<String> = cols
            .split(',')
            .map(|c| c.trim().trim_matches('"').to_string())
            .filter(|c| !c.is_empty())
            .collect();
        out.insert(table, cols);
    }
    out
}

#[test]
fn role_file_grants_exactly_what_runfeed_reads() {
    let sql = role_sql();
    let want: BTreeMap<String, BTreeSet<String>> = grants::required()
        .into_iter()
        .map(|g| {
            (
                g.table.to_string(),
                g.columns.iter().map(|c| c.to_string()).collect(),
            )
        })
        .collect();
    assert_eq!(
        granted_columns(&sql),
        want,
        "{ROLE_SQL} and store::grants::required() disagree"
    );
    let functions: BTreeSet<&str> = sql
        .lines()
        .filter_map(|l| l.strip_prefix("GRANT EXECUTE ON FUNCTION "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(functions, grants::FUNCTIONS.iter().copied().collect());
    // Nothing else: no write privilege, no table-wide SELECT, no role attributes beyond LOGIN.
    let statements: Vec<&str> = sql
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("--"))
        .filter(|l| {
            l.starts_with("GRANT ") || l.starts_with("ALTER ROLE") || l.contains("CREATE ROLE")
        })
        .collect();
    for s in &statements {
        let ok = s.starts_with("GRANT SELECT (")
            || s.starts_with("GRANT EXECUTE ON FUNCTION pg_catalog.")
            || s.starts_with("GRANT USAGE ON SCHEMA :\"schema\" TO :\"role\";")
            || s.contains("'GRANT CONNECT ON DATABASE %I TO %I'")
            || s.contains("'CREATE ROLE %I LOGIN'")
            || s == &"ALTER ROLE :\"role\" SET default_transaction_read_only = on;"
            || s == &"ALTER ROLE :\"role\" PASSWORD :'runfeed_password';";
        assert!(ok, "unexpected statement in {ROLE_SQL}: {s}");
    }
    for forbidden in [
        "INSERT",
        "UPDATE",
        "DELETE",
        "TRUNCATE",
        "ALL PRIVILEGES",
        "SUPERUSER",
        "CREATEDB",
        "REPLICATION",
    ] {
        assert!(
            !statements.iter().any(|s| s.contains(forbidden)),
            "{ROLE_SQL} grants {forbidden}"
        );
    }
}

#[test]
fn granted_columns_parser_reads_a_grant() {
    let got = granted_columns("GRANT SELECT (\n  id, \"apiKey\"\n) ON :\"schema\".\"X\" TO :\"role\";\nGRANT SELECT (a) ON :\"schema\".\"Y\" TO :\"role\";");
    assert_eq!(
        got["X"],
        BTreeSet::from(["id".to_string(), "apiKey".to_string()])
    );
    assert_eq!(got["Y"].len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_read_runs_as_the_role_and_nothing_can_be_written() {
    let rdb = RoleDb::create().await;
    let admin = &rdb.db().pool;
    let env = fixtures::create_env(admin, "PRODUCTION")
        .await
        .expect("env");
    let branch = fixtures::create_branch_env(admin, &env, "PREVIEW", "feature-x")
        .await
        .expect("branch");
    let (batch_id, batch_friendly) = fixtures::create_batch(admin, &env).await.expect("batch");
    let spec = tagged_in_batch(&["a", "b"], &batch_id);
    let tagged = fixtures::create_run(admin, &env, spec).await.expect("run");
    sqlx::query(r#"INSERT INTO "RevokedApiKey" (id, "apiKey", "runtimeEnvironmentId", "expiresAt") VALUES ($1, 'tr_prod_revoked_0123456789', $2, (now() AT TIME ZONE 'UTC') + interval '1 hour')"#)
        .bind(fixtures::new_id())
        .bind(&env.env_id)
        .execute(admin)
        .await
        .expect("revoked key");

    // A distinct "replica" URL (same server) so both pools and the lag probes run as the role.
    let url = rdb.role_url();
    let replica = format!("{url}?application_name=runfeed-replica-pool");
    let store = PgStore::connect_lazy(&url, Some(&replica)).expect("store");
    assert!(store.has_distinct_replica());
    within(WAIT, "grant check", grants::check(&store))
        .await
        .expect("every grant present");

    let cols = ColumnSet::ALL;
    let ok = |what: &str, r: Result<bool, runfeed::store::StoreError>| match r {
        Ok(true) => {}
        Ok(false) => panic!("{what}: wrong result"),
        Err(err) => panic!("{what} as the role: {err}"),
    };
    let e = &EnvId::from(&env.env_id);
    let run = RunId::from(&tagged.id);
    let (run_fid, batch) = (
        FriendlyRunId::from(&tagged.friendly_id),
        BatchId::from(&batch_id),
    );
    let one = std::slice::from_ref(&run);
    let in_batch = |r: Option<RunResource>| {
        r.is_some_and(|r| r.batch_friendly_id.as_deref() == Some(batch_friendly.as_str()))
    };
    let hydrated = store.hydrate(e, one, cols).await;
    ok("hydrate", hydrated.map(|r| r.len() == 1));
    let read = store.read_run(e, &run, cols).await;
    ok("read_run", read.map(|r| r.is_some()));
    let tag_set = store.resolve_tag_set(e, &["a".into()], 0, 10, cols).await;
    ok("tag set", tag_set.map(|r| r.len() == 1));
    let unfiltered = store.resolve_tag_set(e, &[], 0, 10, cols).await;
    ok("unfiltered set", unfiltered.map(|r| r.len() == 1));
    let batch_set = store.resolve_batch_set(e, &batch, 10, cols).await;
    ok("batch set", batch_set.map(|r| r.len() == 1));
    ok("find_run", store.find_run(e, &run_fid).await.map(in_batch));
    let batch_fid = FriendlyBatchId::from(&batch_friendly);
    let found = store.find_batch(e, &batch_fid).await;
    ok("find_batch", found.map(|r| r.is_some()));
    let by_key = store.env_by_api_key(&env.api_key).await;
    ok("env_by_api_key", by_key.map(|r| r.is_some()));
    let by_revoked = store.env_by_revoked_key("tr_prod_revoked_0123456789").await;
    ok("env_by_revoked_key", by_revoked.map(|r| r.is_some()));
    let by_id = store.env_by_id(&EnvId::from(&branch.env_id)).await;
    let has_parent_key =
        |r: Option<runfeed::store::EnvRecord>| r.is_some_and(|b| b.parent_api_key.is_some());
    ok("env_by_id", by_id.map(has_parent_key));
    let branch_env = store.branch_env(e, "feature-x").await;
    ok("branch_env", branch_env.map(|r| r.is_some()));
    ok(
        "revoked_keys",
        store.revoked_keys(e).await.map(|k| k.len() == 1),
    );
    store.primary_lsn().await.expect("primary_lsn as the role");
    assert_eq!(
        store
            .replica_replay_lsn()
            .await
            .expect("replica_replay_lsn as the role"),
        None
    );

    // Nothing can be written: no privilege, and read-only transactions by default.
    let role_pool = sqlx::PgPool::connect(&url).await.expect("role pool");
    let update = sqlx::query(r#"UPDATE "TaskRun" SET status = 'CANCELED' WHERE id = $1"#);
    let update = refused(&role_pool, "an UPDATE as the role", update.bind(&tagged.id)).await;
    let denied = |e: &str| e.contains("permission denied");
    assert!(denied(&update) || update.contains("read-only"), "{update}");
    let create = sqlx::query("CREATE TABLE runfeed_was_here (x int)");
    let create = refused(&role_pool, "a CREATE TABLE as the role", create).await;
    assert!(
        create.contains("read-only transaction") || denied(&create),
        "{create}"
    );
    let secret = sqlx::query(r#"SELECT "pkApiKey" FROM "RuntimeEnvironment""#);
    let secret = refused(&role_pool, "a column runfeed does not read", secret).await;
    assert!(denied(&secret), "{secret}");
    role_pool.close().await;
    drop(store);
    rdb.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_privilege_is_named() {
    let rdb = RoleDb::create().await;
    let url = rdb.role_url();
    let store = PgStore::connect_lazy(&url, None).expect("store");
    grants::check(&store).await.expect("complete grants");

    rdb.admin(r#"REVOKE SELECT ("updatedAt") ON "TaskRun" FROM :"role""#)
        .await;
    rdb.admin(r#"REVOKE EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery() FROM PUBLIC, :"role""#)
        .await;
    let err = grants::check(&store).await.expect_err("a missing grant");
    let text = err.to_string();
    let (server, role, gaps) = missing(err);
    assert_eq!(server, Server::Primary);
    assert_eq!(role, rdb.role);
    assert_eq!(
        gaps,
        [
            Missing::Select {
                table: "TaskRun".into(),
                column: "updatedAt".into()
            },
            Missing::Execute {
                function: "pg_catalog.pg_is_in_recovery()".into()
            },
        ]
    );
    assert!(text.contains(r#"lacks SELECT ("updatedAt") ON "TaskRun", EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery()"#), "{text}");
    assert!(text.contains(ROLE_SQL), "{text}");

    // Re-running the file restores everything (idempotent).
    rdb.psql_file(ROLE_SQL).await;
    rdb.admin("GRANT EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery() TO PUBLIC")
        .await;
    grants::check(&store)
        .await
        .expect("restored by re-running the file");

    // No USAGE on the schema: named as such, not as missing tables.
    rdb.admin(r#"REVOKE USAGE ON SCHEMA public FROM PUBLIC, :"role""#)
        .await;
    let (_, _, gaps) = missing(grants::check(&store).await.expect_err("no schema usage"));
    assert_eq!(
        gaps,
        [Missing::SchemaUsage {
            schema: "public".into()
        }]
    );
    drop(store);
    rdb.cleanup().await;

    // A database without trigger.dev's tables: every table named.
    let empty = format!("runfeed_t_{}", fixtures::new_id());
    runfeed::store::setup::create_database(PG_ADMIN, &empty)
        .await
        .expect("empty database");
    let store =
        PgStore::connect_lazy(&fixtures::database_url(PG_ADMIN, &empty), None).expect("store");
    let (_, _, gaps) = missing(grants::check(&store).await.expect_err("no tables"));
    let tables: Vec<&Missing> = gaps
        .iter()
        .filter(|m| matches!(m, Missing::Table { .. }))
        .collect();
    assert_eq!(tables.len(), grants::required().len(), "{gaps:?}");
    drop(store);
    let _ = runfeed::store::setup::drop_database(PG_ADMIN, &empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_to_start_without_a_grant_and_names_it() {
    let rdb = RoleDb::create().await;
    rdb.admin(r#"REVOKE SELECT ("apiKey") ON "RevokedApiKey" FROM :"role""#)
        .await;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_runfeed"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &rdb.role_url(),
            "--redis-url",
            REDIS_URL,
        ])
        .env("RUNFEED_TELEMETRY__ADMIN_LISTEN", "127.0.0.1:0")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn runfeed");
    let out = within(
        Duration::from_secs(20),
        "runfeed to exit",
        child.wait_with_output(),
    )
    .await
    .expect("runfeed output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "runfeed started without the grant:\n{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("runfeed listening"), "{stdout}");
    assert!(
        stderr.contains(&format!(
            r#"database role "{}" on the primary lacks SELECT ("apiKey") ON "RevokedApiKey""#,
            rdb.role
        )),
        "{stderr}"
    );
    assert!(stderr.contains(ROLE_SQL), "{stderr}");
    rdb.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_naming_a_grant_revoked_while_running() {
    let rdb = RoleDb::create().await;
    let config = test_config(&rdb.role_url(), 1_000);
    let running = within(WAIT, "start runfeed", runfeed::app::start(config))
        .await
        .expect("start as the role");
    let admin = running.admin_addr.expect("admin listener");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let readyz = || {
        let http = http.clone();
        async move {
            let resp = http
                .get(format!("http://{admin}/readyz"))
                .send()
                .await
                .expect("readyz");
            let status = resp.status().as_u16();
            (
                status,
                resp.json::<serde_json::Value>().await.expect("json"),
            )
        }
    };
    let (status, body) = within(WAIT, "readyz", readyz()).await;
    assert_eq!(
        (status, &body["checks"]["grants"]),
        (200, &serde_json::json!("ok")),
        "{body}"
    );

    rdb.admin(r#"REVOKE SELECT ("runTags") ON "TaskRun" FROM :"role""#)
        .await;
    let (status, body) = within(WAIT, "readyz", readyz()).await;
    assert_eq!(status, 503, "{body}");
    let reason = body["checks"]["grants"].as_str().unwrap_or_default();
    assert!(
        reason.contains(r#"SELECT ("runTags") ON "TaskRun""#),
        "{body}"
    );
    assert_eq!(
        body["checks"]["postgres"], "ok",
        "Postgres itself answers: {body}"
    );
    running.stop().await;
    rdb.cleanup().await;
}
