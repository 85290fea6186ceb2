//! `runfeed token`: mints a public access token for an environment as the trigger.dev SDK
//! would (HS256, signed with the environment's root key read from the database; a branch
//! environment signs with its PARENT's key, docs/trigger-dev.md §2.3). Prints only the token.

use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::protocol::EnvId;
use crate::store::{EnvStore, PgStore};

/// `runfeed token --env ENV_ID --scope SCOPE… [--ttl 15m]`.
#[derive(Debug, Args, Clone)]
pub struct TokenArgs {
    #[command(flatten)]
    pub db: super::DbArgs,
    /// Internal environment id.
    #[arg(long)]
    pub env: String,
    /// Scopes, e.g. `read:runs` or `read:tags:user_1` (repeatable).
    #[arg(long = "scope", required = true, num_args = 1..)]
    pub scopes: Vec<String>,
    /// Lifetime, e.g. `15m`, `1h`.
    #[arg(long, default_value = "15m")]
    pub ttl: String,
    /// `realtime.skipColumns` claim, comma-separated.
    #[arg(long)]
    pub skip_columns: Option<String>,
}

/// Parses a `--ttl` such as `15m`, `1h`, `90s`, `1h30m` (humantime syntax).
pub fn parse_ttl(ttl: &str) -> anyhow::Result<std::time::Duration> {
    humantime::parse_duration(ttl)
        .with_context(|| format!("invalid --ttl {ttl:?} (e.g. 15m, 1h, 90s)"))
}

/// Splits a `--skip-columns` value on `,`, trimming items and dropping empty ones.
pub fn parse_skip_columns(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

/// Prints a token (only the token, on stdout).
pub async fn run(args: TokenArgs) -> anyhow::Result<()> {
    let ttl = parse_ttl(&args.ttl)?;
    let skip_columns = args.skip_columns.as_deref().map(parse_skip_columns);
    let store = Arc::new(
        PgStore::connect_lazy(&args.db.database_url, None).context("connect to Postgres")?,
    );
    let env = store
        .env_by_id(&EnvId::new(&args.env))
        .await
        .with_context(|| format!("look up environment {}", args.env))?
        .with_context(|| format!("no environment with id {:?} in the database", args.env))?;
    if env.project_deleted {
        eprintln!("runfeed token: warning: the project of environment {} is deleted; the token will be rejected", env.id);
    }
    let signing_key = env.parent_api_key.as_deref().unwrap_or(&env.api_key);
    let token = crate::auth::mint_public_token(
        signing_key,
        &env.id,
        &args.scopes,
        ttl,
        skip_columns.as_deref(),
    )
    .context("mint the public token")?;
    println!("{token}");
    Ok(())
}
