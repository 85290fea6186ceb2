//! Fault scenarios under load against a running `runfeed serve` (docs/faults.md): each starts
//! a workload of live feeds and changes ([`load`]), injects one fault, and prints its figures.
//! Driven by the `runfeed-faults` binary (one subcommand per fault). Loopback only; every
//! scenario is bounded in clients and time and stops by itself.
//!
//! - [`stalled`]: SSE readers that stop reading while large rows change (RSS per stalled
//!   reader, the healthy readers' delivery p99, streams ended by the queue bound);
//! - [`redis`]: a Redis restart or a network pause (`CLIENT PAUSE`) under load (updates lost,
//!   time to recover, backstop deliveries);
//! - [`cluster`]: a Redis Cluster master failed over to its replica under load (the same
//!   figures);
//! - [`storm`]: every client reconnects within one second (5xx, Postgres queries, time until
//!   every client is back on a live poll);
//! - [`postgres`]: the database stopped and started again, its `max_connections` taken by
//!   another client, or frozen with SIGSTOP while records of new runs arrive (JSON 503s with
//!   `Retry-After`, the slowest one, updates lost; for the freeze the server's RSS and the
//!   router's queue overflows);
//! - [`replica`]: the read replica restarted or promoted (the same figures, and `/readyz`
//!   naming `postgres_replica`);
//! - [`memory`]: bursts of aborted live polls (RSS before, at the peak, 30 s after).

pub mod cluster;
pub mod load;
pub mod memory;
pub mod postgres;
pub mod redis;
pub mod replica;
pub mod stalled;
pub mod storm;

use anyhow::Context;
use clap::Args;
use serde_json::Value;

pub use crate::measure::{metric_sum, pct, proc_cpu_s, proc_rss, tcp_kernel_memory};

/// The server under test and its dependencies.
#[derive(Args, Clone, Debug)]
pub struct Target {
    /// The server's base URL (e.g. http://127.0.0.1:3030).
    #[arg(long, env = "BENCH_BASE_URL")]
    pub base_url: String,
    /// The database the server reads (environments and runs are written into it).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
    /// The Redis the server subscribes to (change records are published there).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// The server's admin listener (/metrics), e.g. http://127.0.0.1:9464.
    #[arg(long, env = "BENCH_ADMIN_URL")]
    pub admin_url: String,
    /// The server's pid (RSS and CPU from /proc).
    #[arg(long)]
    pub server_pid: Option<u32>,
}

/// The sample of `name` whose labels contain `label` (e.g. `result="delivered"`).
pub fn metric_with(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Prints `rows` as a two-column table under `scenario`.
pub fn report(scenario: &str, params: Value, rows: Vec<(&str, Value)>) {
    println!("\n{scenario}  {params}");
    println!("{:<48} {:>16}", "figure", "value");
    println!("{:-<48} {:->16}", "", "");
    for (k, v) in rows {
        let shown = match &v {
            Value::Number(n) => format!("{:.1}", n.as_f64().unwrap_or(0.0)),
            Value::Null => "n/a".into(),
            other => other.to_string(),
        };
        println!("{k:<48} {shown:>16}");
    }
}

/// The admin `/metrics` text.
pub async fn scrape(http: &reqwest::Client, t: &Target) -> anyhow::Result<String> {
    let url = format!("{}/metrics", t.admin_url.trim_end_matches('/'));
    http.get(&url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?
        .text()
        .await
        .context("metrics body")
}
