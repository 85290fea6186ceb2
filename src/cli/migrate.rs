//! `runfeed migrate`: creates the database named in `--database-url` if it does not exist
//! (through the `postgres` maintenance database of the same server), then applies
//! `migrations/` (the trigger.dev tables runfeed reads). Development and tests only. Idempotent.

use std::str::FromStr;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use super::fixtures;

/// Runs the migrations against `--database-url`, creating the database if it does not exist.
pub async fn run(args: super::DbArgs) -> anyhow::Result<()> {
    let (pool, created) = connect_migrated(&args.database_url).await?;
    pool.close().await;
    let name = database_name(&args.database_url)?;
    if created {
        println!("runfeed migrate: created database {name} and applied the migrations");
    } else {
        println!("runfeed migrate: database {name} is up to date");
    }
    Ok(())
}

/// The database named by a Postgres URL (the user name when the URL names none, as libpq does).
pub fn database_name(database_url: &str) -> anyhow::Result<String> {
    let options = PgConnectOptions::from_str(database_url)
        .with_context(|| format!("invalid --database-url {database_url:?}"))?;
    Ok(options
        .get_database()
        .unwrap_or(options.get_username())
        .to_string())
}

/// Ensures the database of `database_url` exists, connects to it and applies the migrations.
/// Returns the pool and whether the database had to be created. Shared with `runfeed demo`.
pub async fn connect_migrated(database_url: &str) -> anyhow::Result<(PgPool, bool)> {
    let name = database_name(database_url)?;
    let options = PgConnectOptions::from_str(database_url)
        .with_context(|| format!("invalid --database-url {database_url:?}"))?;
    let connect = || {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.clone())
    };
    let (pool, created) = match connect().await {
        Ok(pool) => (pool, false),
        // invalid_catalog_name: the database does not exist yet.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            let created = fixtures::create_database(database_url, &name)
                .await
                .with_context(|| format!("create database {name}"))?;
            let pool = connect()
                .await
                .with_context(|| format!("connect to database {name}"))?;
            (pool, created)
        }
        Err(e) => return Err(e).with_context(|| format!("connect to database {name}")),
    };
    crate::store::migrate(&pool)
        .await
        .with_context(|| format!("apply migrations to database {name}"))?;
    Ok((pool, created))
}
