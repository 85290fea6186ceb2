//! The command line (clap): `serve`, `migrate`, `publish`, `token`, `config-reference`.
//! (The demo workload is `runfeed-demo`, in the development crate `crates/runfeed-dev`.)
//! `serve` is in [`crate::app`]; the others live here.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

pub mod migrate;
pub mod publish;
pub mod token;

/// runfeed: trigger.dev realtime run feeds (Electric shape protocol) from Postgres + Redis.
#[derive(Debug, Parser)]
#[command(name = "runfeed", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the realtime feeds.
    Serve(ServeArgs),
    /// Create the trigger.dev tables runfeed reads (development and tests only). Idempotent.
    Migrate(DbArgs),
    /// Publish one change record exactly as trigger.dev's webapp does.
    Publish(publish::PublishArgs),
    /// Mint a public access token for an environment (signed with its key from the database).
    Token(token::TokenArgs),
    /// Print the configuration reference (Markdown: every key, its environment variable, type,
    /// default and description), generated from the config struct.
    ConfigReference,
}

/// Connection flags shared by the commands.
#[derive(Debug, Args, Clone)]
pub struct DbArgs {
    /// The primary Postgres.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/runfeed_demo"
    )]
    pub database_url: String,
}

/// Redis connection flag shared by the commands.
#[derive(Debug, Args, Clone)]
pub struct RedisArgs {
    /// The Redis carrying change records.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
}

/// `runfeed serve`.
#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Listen address.
    #[arg(long, env = "RUNFEED_LISTEN")]
    pub listen: Option<String>,
    /// The primary Postgres.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// The read replica (defaults to the primary).
    #[arg(long, env = "DATABASE_READ_REPLICA_URL")]
    pub replica_url: Option<String>,
    /// The Redis carrying change records.
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// TOML configuration file (every key and its default: config/default.toml).
    #[arg(long, env = "RUNFEED_CONFIG")]
    pub config: Option<PathBuf>,
    /// Hydrate from the primary and disable the replica-lag gate (reference `RUN_READS_FROM_PRIMARY`).
    #[arg(long)]
    pub run_reads_from_primary: bool,
}
