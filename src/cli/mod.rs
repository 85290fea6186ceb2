//! The command line (clap): `serve`, `migrate`, `publish`, `token`, `config-reference`, and
//! [`run`], which carries one out. `serve` loads the configuration here and hands it to
//! [`crate::app::serve`]. (The demo workload is `runfeed-demo`, in the development crate
//! `crates/runfeed-dev`.)

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{Config, ConfigError};

pub mod migrate;
pub mod publish;
pub mod reference;
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
    /// Print the metric reference (Markdown: every Prometheus metric, its type, unit, labels
    /// and meaning), generated from the instrument declarations.
    MetricsReference,
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

impl ServeArgs {
    /// The configuration `serve` runs with: built-in defaults ← `--config` file ← `RUNFEED_*`
    /// environment ← these flags, validated.
    ///
    /// Errors: [`ConfigError`] (unreadable file, unknown key, invalid value).
    pub fn load_config(self) -> Result<Config, ConfigError> {
        let mut config = Config::load(self.config.as_deref())?;
        if let Some(listen) = self.listen {
            config.server.listen = listen;
        }
        if let Some(url) = self.database_url {
            config.database.url = url;
        }
        if let Some(url) = self.replica_url {
            config.database.replica_url = Some(url);
        }
        if let Some(url) = self.redis_url {
            config.redis.url = url;
        }
        if self.run_reads_from_primary {
            config.database.run_reads_from_primary = true;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Carries out one command. `serve` returns after SIGINT/SIGTERM and a graceful drain.
///
/// Errors: whatever the command failed on, with context (printed by `main`).
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => {
            let config = args.load_config()?;
            crate::telemetry::init_logging_with(&config.telemetry.log_format);
            crate::app::serve(config).await
        }
        Command::Migrate(args) => {
            crate::telemetry::init_logging();
            migrate::run(args).await
        }
        Command::Publish(args) => {
            crate::telemetry::init_logging();
            publish::run(args).await
        }
        Command::Token(args) => {
            crate::telemetry::init_logging();
            token::run(args).await
        }
        Command::ConfigReference => {
            print!("{}", reference::reference_markdown());
            Ok(())
        }
        Command::MetricsReference => {
            print!("{}", reference::metrics_reference_markdown());
            Ok(())
        }
    }
}
