//! `runfeed migrate`: creates the database named in `--database-url` if it does not exist
//! (through the `postgres` maintenance database of the same server), then applies
//! `migrations/` (the trigger.dev tables runfeed reads). Development and tests only. Idempotent.

use crate::store::setup;

/// Runs the migrations against `--database-url`, creating the database if it does not exist.
///
/// Errors: an invalid URL, an unreachable server, a failed migration.
pub async fn run(args: super::DbArgs) -> anyhow::Result<()> {
    let (pool, created) = setup::connect_migrated(&args.database_url).await?;
    pool.close().await;
    let name = setup::database_name(&args.database_url)?;
    if created {
        println!("runfeed migrate: created database {name} and applied the migrations");
    } else {
        println!("runfeed migrate: database {name} is up to date");
    }
    Ok(())
}
