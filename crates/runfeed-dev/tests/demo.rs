//! Integration tests of `runfeed-demo` and the fixtures, driving the built binary against a real
//! Postgres and Redis.
//!
//! Postgres: `RUNFEED_TEST_PG` (default `postgres://postgres@127.0.0.1:5432`); every test uses its
//! own `runfeed_t_<random>` database and drops it. Redis: `RUNFEED_TEST_REDIS` (default
//! `redis://127.0.0.1:6379`).

use std::collections::HashMap;
use std::process::Output;
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use fred::prelude::*;
use runfeed_dev::fixtures::{self, TestDb};
use serde_json::Value;
use sqlx::Row;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn pg_base() -> String {
    std::env::var("RUNFEED_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_string())
}

fn redis_url() -> String {
    std::env::var("RUNFEED_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string())
}

fn unique(prefix: &str) -> String {
    format!("{prefix}{}", &fixtures::new_id()[1..13])
}

fn runfeed() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_runfeed-demo"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .kill_on_drop(true);
    cmd
}

async fn run_ok(cmd: &mut Command) -> anyhow::Result<Output> {
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .context("command timed out")??;
    anyhow::ensure!(
        out.status.success(),
        "command failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// `KEY=value` lines of the demo's output.
fn machine_lines(stdout: &str) -> HashMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn jwt_payload(token: &str) -> anyhow::Result<Value> {
    let parts: Vec<&str> = token.split('.').collect();
    anyhow::ensure!(parts.len() == 3, "not a JWT: {token:?}");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(parts[1])?;
    Ok(serde_json::from_slice(&bytes)?)
}

fn verifies_with(token: &str, key: &str) -> bool {
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
    validation.set_issuer(&["https://id.trigger.dev"]);
    validation.set_audience(&["https://api.trigger.dev"]);
    match jsonwebtoken::DecodingKey::from_secret(key.as_bytes()) {
        Ok(decoding) => jsonwebtoken::decode::<Value>(token, &decoding, &validation).is_ok(),
        Err(_) => false,
    }
}

async fn subscriber(
    channel: &str,
) -> anyhow::Result<(
    Client,
    tokio::sync::broadcast::Receiver<fred::types::Message>,
)> {
    let client = Client::new(Config::from_url(&redis_url())?, None, None, None);
    client.init().await?;
    let rx = client.message_rx();
    client.subscribe(channel).await?;
    Ok((client, rx))
}

#[tokio::test]
async fn demo_seed_only_prints_machine_lines_and_seeds_the_database() -> anyhow::Result<()> {
    let name = unique("runfeed_t_");
    let url = fixtures::database_url(&pg_base(), &name);
    let result = async {
        let out = run_ok(runfeed().args(["--seed-only", "--database-url", &url, "--redis-url", &redis_url()])).await?;
        let stdout = String::from_utf8(out.stdout)?;
        let first = stdout.lines().next().unwrap_or_default();
        let kv = machine_lines(&stdout);
        for key in ["ENV_ID", "SECRET_KEY", "PUBLIC_TOKEN", "RUN_ID", "BATCH_ID", "TAG"] {
            assert!(kv.contains_key(key), "missing {key}= in:\n{stdout}");
        }
        let env_id = &kv["ENV_ID"];
        assert_eq!(first, format!("runfeed-demo: environment {env_id} seeded"));
        assert_eq!(kv["TAG"], "user:alice");
        let key = &kv["SECRET_KEY"];
        assert!(key.starts_with("tr_dev_") && key.len() == 31 && key[7..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert!(kv["RUN_ID"].starts_with("run_"));
        assert!(kv["BATCH_ID"].starts_with("batch_"));

        let token = &kv["PUBLIC_TOKEN"];
        let claims = jwt_payload(token)?;
        assert_eq!(claims["pub"], Value::Bool(true));
        assert_eq!(claims["sub"].as_str(), Some(env_id.as_str()));
        assert_eq!(claims["scopes"], serde_json::json!(["read:runs", "read:tags", "read:batch"]));
        assert!(verifies_with(token, key));

        let pool = sqlx::PgPool::connect(&url).await?;
        let env = sqlx::query(r#"SELECT "apiKey", type::text FROM "RuntimeEnvironment" WHERE id = $1"#)
            .bind(env_id)
            .fetch_one(&pool)
            .await?;
        assert_eq!(&env.try_get::<String, _>(0)?, key);
        assert_eq!(env.try_get::<String, _>(1)?, "DEVELOPMENT");
        let status: String = sqlx::query_scalar(
            r#"SELECT status::text FROM "TaskRun" WHERE "friendlyId" = $1 AND "runtimeEnvironmentId" = $2"#,
        )
        .bind(&kv["RUN_ID"])
        .bind(env_id)
        .fetch_one(&pool)
        .await?;
        assert_eq!(status, "PENDING");
        let in_batch: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM "TaskRun" r JOIN "BatchTaskRun" b ON b.id = r."batchId"
               WHERE b."friendlyId" = $1 AND r."runtimeEnvironmentId" = $2 AND b."runtimeEnvironmentId" = $2"#,
        )
        .bind(&kv["BATCH_ID"])
        .bind(env_id)
        .fetch_one(&pool)
        .await?;
        assert!(in_batch >= 3, "batch has {in_batch} runs");
        let alice: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "runTags" @> ARRAY['user:alice']"#,
        )
        .bind(env_id)
        .fetch_one(&pool)
        .await?;
        assert!(alice >= 2);
        let weird: Vec<String> = sqlx::query_scalar(r#"SELECT "runTags" FROM "TaskRun" WHERE "friendlyId" = $1"#)
            .bind(&kv["WEIRD_RUN_ID"])
            .fetch_one(&pool)
            .await?;
        assert!(weird.iter().any(|t| t.contains('"') && t.contains('\\')), "{weird:?}");
        assert!(weird.iter().any(|t| t == "NULL"));
        let errors: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND error IS NOT NULL"#,
        )
        .bind(env_id)
        .fetch_one(&pool)
        .await?;
        assert!(errors >= 1);
        // updatedAt is never in the future (it is written as UTC wall-clock time).
        let future: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM "TaskRun" WHERE "updatedAt" > (now() AT TIME ZONE 'UTC') + interval '1 second'"#,
        )
        .fetch_one(&pool)
        .await?;
        assert_eq!(future, 0);
        pool.close().await;
        anyhow::Ok(())
    }
    .await;
    runfeed::store::setup::drop_database(&pg_base(), &name).await?;
    result
}

#[tokio::test]
async fn demo_twice_reuses_the_environment() -> anyhow::Result<()> {
    let name = unique("runfeed_t_");
    let url = fixtures::database_url(&pg_base(), &name);
    let result = async {
        let args = [
            "--seed-only",
            "--database-url",
            &url,
            "--redis-url",
            &redis_url(),
        ];
        let first = machine_lines(&String::from_utf8(
            run_ok(runfeed().args(args)).await?.stdout,
        )?);
        let second = machine_lines(&String::from_utf8(
            run_ok(runfeed().args(args)).await?.stdout,
        )?);
        assert_eq!(first["ENV_ID"], second["ENV_ID"]);
        assert_eq!(first["SECRET_KEY"], second["SECRET_KEY"]);
        assert_ne!(first["RUN_ID"], second["RUN_ID"]);
        assert_ne!(first["BATCH_ID"], second["BATCH_ID"]);
        anyhow::Ok(())
    }
    .await;
    runfeed::store::setup::drop_database(&pg_base(), &name).await?;
    result
}

#[tokio::test]
async fn demo_workload_publishes_after_committing() -> anyhow::Result<()> {
    let name = unique("runfeed_t_");
    let url = fixtures::database_url(&pg_base(), &name);
    let result = async {
        let mut child = runfeed()
            .args(["--database-url", &url, "--redis-url", &redis_url(), "--interval-ms", "50"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut kv = HashMap::new();
        while let Some(line) = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await?? {
            if let Some((k, v)) = line.split_once('=') {
                kv.insert(k.to_string(), v.to_string());
            }
            if kv.contains_key("RUN_ID") && kv.contains_key("ENV_ID") {
                break;
            }
        }
        let env_id = kv.get("ENV_ID").context("ENV_ID")?.clone();
        let (client, mut rx) = subscriber(&format!("realtime:env:{{{env_id}}}")).await?;
        let mut records = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while let Ok(Ok(msg)) = tokio::time::timeout_at(deadline, rx.recv()).await {
            records.push(serde_json::from_str::<Value>(&msg.value.convert::<String>()?)?);
        }
        client.quit().await?;
        // Ctrl-C: a graceful exit.
        let pid = child.id().context("pid")?;
        std::process::Command::new("kill").args(["-INT", &pid.to_string()]).status()?;
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
        assert!(status.success(), "demo exited with {status}");

        assert!(records.len() >= 10, "only {} records", records.len());
        assert!(records.iter().all(|r| r["v"] == 1 && r["envId"] == env_id.as_str() && r["tags"].is_array()));
        let (with, without): (Vec<&Value>, Vec<&Value>) = records.iter().partition(|r| r.get("updatedAtMs").is_some());
        assert!(!with.is_empty() && !without.is_empty());

        let pool = sqlx::PgPool::connect(&url).await?;
        for r in &with {
            let run_id = r["runId"].as_str().context("runId")?;
            let row = sqlx::query(
                r#"SELECT (extract(epoch from "updatedAt") * 1000)::int8, "runtimeEnvironmentId" FROM "TaskRun" WHERE id = $1"#,
            )
            .bind(run_id)
            .fetch_one(&pool)
            .await?;
            let committed: i64 = row.try_get(0)?;
            assert!(committed >= r["updatedAtMs"].as_i64().context("updatedAtMs")?, "record {r} ahead of the DB");
            assert_eq!(row.try_get::<String, _>(1)?, env_id);
        }
        // The watch run moved.
        let watch_status: String = sqlx::query_scalar(r#"SELECT status::text FROM "TaskRun" WHERE "friendlyId" = $1"#)
            .bind(&kv["RUN_ID"])
            .fetch_one(&pool)
            .await?;
        assert_ne!(watch_status, "PENDING");
        pool.close().await;
        anyhow::Ok(())
    }
    .await;
    runfeed::store::setup::drop_database(&pg_base(), &name).await?;
    result
}

#[tokio::test]
async fn fixtures_update_run_returns_the_committed_updated_at() -> anyhow::Result<()> {
    let db = TestDb::create(&pg_base()).await?;
    let result = async {
        let env = fixtures::create_env(&db.pool, "DEVELOPMENT").await?;
        let (batch_id, batch_friendly) = fixtures::create_batch(&db.pool, &env).await?;
        assert_eq!(batch_friendly, format!("batch_{batch_id}"));
        let run = fixtures::create_run(
            &db.pool,
            &env,
            fixtures::RunSpec {
                tags: Some(vec!["a".into()]),
                batch_id: Some(batch_id.clone()),
                created_at_ms: Some(1_700_000_000_123),
                ..Default::default()
            },
        )
        .await?;
        assert_eq!(run.created_at_ms, 1_700_000_000_123);
        assert_eq!(run.friendly_id, format!("run_{}", run.id));
        let now = chrono::Utc::now().timestamp_millis();
        assert!((run.updated_at_ms - now).abs() < 5_000);
        let mut last = run.updated_at_ms;
        for _ in 0..3 {
            let set = fixtures::RunUpdate { metadata: Some(r#"{"p":1}"#.into()), ..Default::default() };
            let next = fixtures::update_run(&db.pool, &run.id, set).await?;
            assert!(next > last, "updatedAt must strictly increase");
            last = next;
        }
        let row = sqlx::query(
            r#"SELECT (extract(epoch from "updatedAt") * 1000)::int8, metadata, "batchId", "runTags" FROM "TaskRun" WHERE id = $1"#,
        )
        .bind(&run.id)
        .fetch_one(&db.pool)
        .await?;
        assert_eq!(row.try_get::<i64, _>(0)?, last);
        assert_eq!(row.try_get::<Option<String>, _>(1)?.as_deref(), Some(r#"{"p":1}"#));
        assert_eq!(row.try_get::<Option<String>, _>(2)?, Some(batch_id));
        assert_eq!(row.try_get::<Option<Vec<String>>, _>(3)?, Some(vec!["a".to_string()]));
        let done = fixtures::update_run(
            &db.pool,
            &run.id,
            fixtures::RunUpdate {
                status: Some("COMPLETED_WITH_ERRORS".into()),
                error: Some(serde_json::json!({"type": "STRING_ERROR", "raw": "boom"})),
                completed_at: Some(fixtures::Stamp::Now),
                updated_at_ms: Some(1_800_000_000_000),
                ..Default::default()
            },
        )
        .await?;
        assert_eq!(done, 1_800_000_000_000);
        assert!(fixtures::update_run(&db.pool, "missing", fixtures::RunUpdate::default()).await.is_err());
        anyhow::Ok(())
    }
    .await;
    db.cleanup().await?;
    result
}
