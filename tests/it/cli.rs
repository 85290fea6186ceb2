//! Integration tests of the CLI subcommands (`migrate`, `publish`, `token`), driving the
//! built binary against a real Postgres and Redis.
//!
//! Postgres: `RUNFEED_TEST_PG` (default `postgres://postgres@127.0.0.1:5432`); every test uses its
//! own `runfeed_t_<random>` database and drops it. Redis: `RUNFEED_TEST_REDIS` (default
//! `redis://127.0.0.1:6379`).

use crate::common;

use std::process::Output;
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use common::{pg_base, redis_url, with_test_db};
use fred::prelude::*;
use runfeed_dev::fixtures;
use serde_json::Value;
use tokio::process::Command;

fn unique(prefix: &str) -> String {
    format!("{prefix}{}", &fixtures::new_id()[1..13])
}

fn runfeed() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_runfeed"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .kill_on_drop(true);
    cmd
}

/// `runfeed token --database-url <db_url> --env <env> <args…>`.
fn token(db_url: &str, env: &str, args: &[&str]) -> Command {
    let mut cmd = runfeed();
    cmd.args(["token", "--database-url", db_url, "--env", env])
        .args(args);
    cmd
}

/// `runfeed publish --redis-url <redis> --env <env> --run <run> <args…>`.
fn publish(env: &str, run: &str, args: &[&str]) -> Command {
    let mut cmd = runfeed();
    cmd.args([
        "publish",
        "--redis-url",
        &redis_url(),
        "--env",
        env,
        "--run",
        run,
    ])
    .args(args);
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

async fn next_message(
    rx: &mut tokio::sync::broadcast::Receiver<fred::types::Message>,
) -> anyhow::Result<String> {
    let msg = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .context("no message within 5 s")??;
    Ok(msg.value.convert::<String>()?)
}

/// `runfeed --version` (and `-V`) prints the crate version, the one the chart's `appVersion`
/// and the image tags pin (tests/deploy/helm_chart.rs, tests/deploy/deploy.rs).
#[tokio::test]
async fn version_prints_the_release_version() -> anyhow::Result<()> {
    for flag in ["--version", "-V"] {
        let out = run_ok(runfeed().arg(flag)).await?;
        let printed = String::from_utf8(out.stdout)?;
        assert_eq!(printed, format!("runfeed {}\n", env!("CARGO_PKG_VERSION")));
        let version = printed.trim_start_matches("runfeed ").trim_end();
        let parts: Vec<&str> = version.split('.').collect();
        assert!(
            parts.len() == 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()),
            "{flag} prints a semantic version, not {printed:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn migrate_creates_the_database_and_is_idempotent() -> anyhow::Result<()> {
    let name = unique("runfeed_t_");
    let url = fixtures::database_url(&pg_base(), &name);
    let result = async {
        let first = run_ok(runfeed().args(["migrate", "--database-url", &url])).await?;
        assert!(String::from_utf8_lossy(&first.stdout).contains(&name));
        run_ok(runfeed().args(["migrate", "--database-url", &url])).await?;
        let pool = sqlx::PgPool::connect(&url).await?;
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1",
        )
        .fetch_all(&pool)
        .await?;
        pool.close().await;
        for t in ["TaskRun", "RuntimeEnvironment", "BatchTaskRun", "Organization", "Project", "RevokedApiKey"] {
            assert!(tables.iter().any(|x| x == t), "missing table {t} in {tables:?}");
        }
        anyhow::Ok(())
    }
    .await;
    runfeed::store::setup::drop_database(&pg_base(), &name).await?;
    result
}

#[tokio::test]
async fn token_prints_a_public_jwt_signed_with_the_env_key() -> anyhow::Result<()> {
    with_test_db(async |db| {
        let env = fixtures::create_env(&db.pool, "PRODUCTION").await?;
        let out = run_ok(&mut token(
            &db.url,
            &env.env_id,
            &[
                "--scope",
                "read:runs",
                "--scope",
                "read:tags:user:1",
                "--ttl",
                "1h",
                "--skip-columns",
                "payload, output",
            ],
        ))
        .await?;
        let stdout = String::from_utf8(out.stdout)?;
        assert_eq!(
            stdout.lines().count(),
            1,
            "stdout must hold only the token: {stdout:?}"
        );
        let token = stdout.trim();
        let claims = jwt_payload(token)?;
        assert_eq!(claims["pub"], Value::Bool(true));
        assert_eq!(claims["sub"].as_str(), Some(env.env_id.as_str()));
        assert_eq!(
            claims["scopes"],
            serde_json::json!(["read:runs", "read:tags:user:1"])
        );
        assert_eq!(claims["iss"], "https://id.trigger.dev");
        assert_eq!(claims["aud"], "https://api.trigger.dev");
        assert_eq!(
            claims["realtime"]["skipColumns"],
            serde_json::json!(["payload", "output"])
        );
        let exp = claims["exp"].as_i64().context("exp")?;
        let now = chrono::Utc::now().timestamp();
        assert!((exp - now - 3600).abs() <= 5, "exp {exp} now {now}");
        assert!(verifies_with(token, &env.api_key));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn token_for_a_branch_env_is_signed_with_the_parent_key() -> anyhow::Result<()> {
    with_test_db(async |db| {
        let parent = fixtures::create_env(&db.pool, "PREVIEW").await?;
        let branch = fixtures::create_branch_env(&db.pool, &parent, "PREVIEW", "feature-x").await?;
        let out = run_ok(&mut token(
            &db.url,
            &branch.env_id,
            &["--scope", "read:all"],
        ))
        .await?;
        let token = String::from_utf8(out.stdout)?.trim().to_string();
        let claims = jwt_payload(&token)?;
        assert_eq!(claims["sub"].as_str(), Some(branch.env_id.as_str()));
        let ttl = claims["exp"].as_i64().context("exp")? - claims["iat"].as_i64().context("iat")?;
        assert_eq!(ttl, 15 * 60, "default ttl is 15m");
        assert!(verifies_with(&token, &parent.api_key));
        assert!(!verifies_with(&token, &branch.api_key));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn token_for_an_unknown_env_fails_without_printing() -> anyhow::Result<()> {
    with_test_db(async |db| {
        let out = token(&db.url, "no_such_env", &["--scope", "read:runs"])
            .output()
            .await?;
        assert!(!out.status.success());
        assert!(out.stdout.is_empty());
        assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_env"));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn publish_delivers_exactly_the_webapp_json() -> anyhow::Result<()> {
    let env = unique("e1_");
    let (client, mut rx) = subscriber(&format!("realtime:env:{{{env}}}")).await?;
    let full = ["--tags", "a,b", "--updated-at-ms", "123"];
    run_ok(&mut publish(&env, "r1", &full)).await?;
    assert_eq!(
        next_message(&mut rx).await?,
        format!(
            r#"{{"v":1,"runId":"r1","envId":"{env}","tags":["a","b"],"batchId":null,"updatedAtMs":123}}"#
        )
    );
    // Lifecycle-bus shape: full record, internal batch id, no watermark.
    run_ok(&mut publish(&env, "r2", &["--tags", "", "--batch", "b1"])).await?;
    assert_eq!(
        next_message(&mut rx).await?,
        format!(r#"{{"v":1,"runId":"r2","envId":"{env}","tags":[],"batchId":"b1"}}"#)
    );
    client.quit().await?;
    Ok(())
}
