//! Postgres faults under load: the server's database is an own instance (scripts/pg-instance.sh
//! on `--pg-port`, never the shared one) that is stopped for `--fault-ms` and started again
//! (`restart`), or whose `max_connections` another client takes while runfeed's own connections
//! are cut (`exhaust`), while `--feeds` followers hold live polls and `--rate` changes/s are
//! written (the writer's own commits fail during the fault: they are not counted). Figures:
//! 5xx seen (all must be JSON 503 with `Retry-After`), the slowest 503, followers behind after
//! the fault (lost updates), and the time until every follower converged.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;
use tokio::time::Instant;

use super::load::{Load, LoadArgs};
use super::{report, Target};

/// Which Postgres fault.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PgFault {
    /// `pg_ctl stop -m fast`, then start again after `--fault-ms`.
    Restart,
    /// Another client takes every connection slot for `--fault-ms` and runfeed's connections are
    /// terminated.
    Exhaust,
}

/// `runfeed-faults postgres`.
#[derive(Args, Clone, Debug)]
pub struct PostgresArgs {
    #[command(flatten)]
    pub target: Target,
    /// The fault.
    #[arg(long, value_enum)]
    pub fault: PgFault,
    /// Port of the server's own Postgres (scripts/pg-instance.sh); never 5432.
    #[arg(long)]
    pub pg_port: u16,
    /// How long the fault lasts, ms.
    #[arg(long, default_value_t = 5_000)]
    pub fault_ms: u64,
    #[command(flatten)]
    pub load: LoadArgs,
}

fn pg_instance(args: &[&str]) -> anyhow::Result<()> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pg-instance.sh");
    let status = Command::new("bash").arg(script).args(args).status()?;
    anyhow::ensure!(status.success(), "pg-instance.sh {args:?}");
    Ok(())
}

/// Snapshot probes every 50 ms while `probing`: each must be a 200 or a JSON 503 with
/// Retry-After, never a hang (counted in the load's outcomes). The task returns
/// `(probes, answered 200)`.
pub(super) fn spawn_probes(
    load: &Arc<Load>,
    probing: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, u64)> {
    let (load, probing) = (load.clone(), probing.clone());
    tokio::spawn(async move {
        let (mut n, mut ok) = (0u64, 0u64);
        let mut tasks = Vec::new();
        while probing.load(Ordering::Relaxed) {
            let load = load.clone();
            let i = n as usize;
            tasks.push(tokio::spawn(async move { load.snapshot_probe(i).await }));
            n += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for t in tasks {
            if t.await.ok().flatten() == Some(200) {
                ok += 1;
            }
        }
        (n, ok)
    })
}

/// Runs the scenario and prints its figures.
pub async fn run(a: PostgresArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.pg_port != 5432, "never the shared Postgres");
    let load = Load::start(&a.target, a.load.feeds, a.load.runs).await?;
    let writer = load.start_writer(a.load.rate);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let port = a.pg_port.to_string();
    let probing = Arc::new(AtomicBool::new(true));
    let probes = spawn_probes(&load, &probing);
    let fault_at = Instant::now();
    match a.fault {
        PgFault::Restart => {
            pg_instance(&["stop", "--port", &port])?;
            tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
            pg_instance(&["resume", "--port", &port])?;
        }
        PgFault::Exhaust => {
            use sqlx::Connection;
            let url = a.target.database_url.clone();
            let mut hog = Vec::new();
            while let Ok(c) = sqlx::PgConnection::connect(&url).await {
                hog.push(c);
                if hog.len() > 10_000 {
                    break;
                }
            }
            if let Some(first) = hog.first_mut() {
                sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'runfeed'")
                    .execute(&mut *first)
                    .await?;
            }
            while let Ok(c) = sqlx::PgConnection::connect(&url).await {
                hog.push(c);
            }
            tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
            drop(hog);
        }
    }
    let rows = after_fault(&load, &probing, probes, writer, fault_at.elapsed()).await?;
    report(
        "postgres",
        json!({"fault": format!("{:?}", a.fault).to_lowercase(), "fault_ms": a.fault_ms, "feeds": a.load.feeds, "runs": a.load.runs, "rate": a.load.rate}),
        rows,
    );
    Ok(())
}

/// After a database fault: probes for 3 s more, then stops them (and whatever else watches
/// `probing`), lets the writer run 10 s more, stops it, waits until every follower converged
/// (at most 60 s) and stops the load; the figures of a database fault.
pub(super) async fn after_fault(
    load: &Arc<Load>,
    probing: &AtomicBool,
    probes: tokio::task::JoinHandle<(u64, u64)>,
    writer: tokio::task::JoinHandle<u64>,
    fault_took: Duration,
) -> anyhow::Result<Vec<(&'static str, serde_json::Value)>> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    probing.store(false, Ordering::Relaxed);
    let (probed, probed_ok) = probes.await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    load.stop_writer();
    let written = writer.await?;
    let (behind, converged_in) = load.converge(Duration::from_secs(60)).await;
    load.stop();
    let o = &load.outcomes;
    Ok(vec![
        ("fault window, s", json!(fault_took.as_secs_f64())),
        ("changes committed", json!(written)),
        ("snapshot probes (every 50 ms)", json!(probed)),
        ("snapshot probes answered 200", json!(probed_ok)),
        (
            "5xx seen by clients",
            json!(o.server_errors.load(Ordering::Relaxed)),
        ),
        (
            "5xx without JSON error or Retry-After",
            json!(o.bare_5xx.load(Ordering::Relaxed)),
        ),
        (
            "slowest 5xx, ms",
            json!(o.slowest_5xx_ms.load(Ordering::Relaxed)),
        ),
        (
            "transport errors (incl. client timeouts)",
            json!(o.transport_errors.load(Ordering::Relaxed)),
        ),
        ("followers behind after 60 s (lost updates)", json!(behind)),
        (
            "time until all converged, s",
            json!(converged_in.as_secs_f64()),
        ),
    ])
}
