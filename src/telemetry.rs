//! Logging setup (tracing). Metrics come with their own issue.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber: `RUST_LOG` filter (default `info`, sqlx notices muted), JSON lines when
/// `RUNFEED_LOG_FORMAT=json`, pretty otherwise. Logs go to stderr. Safe to call twice.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    let json = std::env::var("RUNFEED_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
