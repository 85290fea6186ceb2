//! Read-replica faults under load: the server reads from a streaming replica of its own
//! database (`scripts/replica.sh start --primary-port …` on `--replica-port`), and the replica is
//! restarted (`pg_ctl stop -m fast`, started again after `--fault-ms`) or promoted
//! (`pg_ctl promote`: it leaves recovery and stops following the primary) while `--feeds`
//! followers hold live polls and `--rate` changes/s are committed on the primary. Figures:
//! snapshot probes every 50 ms (all 5xx must be JSON 503 with `Retry-After`, none may hang past
//! the client's 60 s timeout), `/readyz` samples every 100 ms that name `postgres_replica`
//! (503 while it is down, 200 degraded while it is promoted and reads go to the primary),
//! followers behind 60 s after the writer stopped (lost updates), and the time until every
//! follower converged.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;
use tokio::time::Instant;

use super::load::{Load, LoadArgs};
use super::postgres::{after_fault, spawn_probes};
use super::{report, Target};

/// Which replica fault.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ReplicaFault {
    /// `pg_ctl stop -m fast`, started again after `--fault-ms`.
    Restart,
    /// `pg_ctl promote`: the replica becomes a primary of its own.
    Promote,
}

/// `runfeed-faults replica`.
#[derive(Args, Clone, Debug)]
pub struct ReplicaArgs {
    #[command(flatten)]
    pub target: Target,
    /// The fault.
    #[arg(long, value_enum)]
    pub fault: ReplicaFault,
    /// Port of the server's read replica (scripts/replica.sh); never the tests' 5433.
    #[arg(long)]
    pub replica_port: u16,
    /// How long the replica is down (restart), ms.
    #[arg(long, default_value_t = 5_000)]
    pub fault_ms: u64,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// `/readyz` samples that name `postgres_replica` (not `ok`).
#[derive(Default)]
struct Readiness {
    samples: u64,
    /// 503s naming it, and one such body.
    failing: u64,
    failing_body: Option<String>,
    /// 200s naming it (degraded: reads go to the primary), and one such body.
    degraded: u64,
    degraded_body: Option<String>,
}

/// Polls `/readyz` every 100 ms while `polling`.
fn spawn_readyz(t: &Target, polling: &Arc<AtomicBool>) -> tokio::task::JoinHandle<Readiness> {
    let url = format!("{}/readyz", t.admin_url.trim_end_matches('/'));
    let polling = polling.clone();
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap_or_default();
        let mut r = Readiness::default();
        while polling.load(Ordering::Relaxed) {
            r.samples += 1;
            if let Ok(resp) = http.get(&url).send().await {
                let status = resp.status().as_u16();
                let body: serde_json::Value = resp.json().await.unwrap_or_default();
                let named = body["checks"]["postgres_replica"]
                    .as_str()
                    .is_some_and(|c| c != "ok");
                match status {
                    503 if named => {
                        r.failing += 1;
                        r.failing_body.get_or_insert(body.to_string());
                    }
                    200 if named => {
                        r.degraded += 1;
                        r.degraded_body.get_or_insert(body.to_string());
                    }
                    _ => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        r
    })
}

/// Runs the scenario and prints its figures.
pub async fn run(a: ReplicaArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.replica_port != 5433, "never the tests' replica");
    let load = Load::start(&a.target, a.load.feeds, a.load.runs).await?;
    let writer = load.start_writer(a.load.rate);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let probing = Arc::new(AtomicBool::new(true));
    let probes = spawn_probes(&load, &probing);
    let readyz = spawn_readyz(&a.target, &probing);
    let port = a.replica_port.to_string();
    let fault_at = Instant::now();
    let mut script = Command::new("bash");
    script.args(["scripts/replica.sh"]);
    match a.fault {
        ReplicaFault::Restart => {
            let down = a.fault_ms.to_string();
            script.args(["restart", "--port", &port, "--down-ms", &down])
        }
        ReplicaFault::Promote => script.args(["promote", "--port", &port]),
    };
    let status = tokio::task::spawn_blocking(move || script.status()).await??;
    anyhow::ensure!(status.success(), "scripts/replica.sh {:?} failed", a.fault);
    let mut rows = after_fault(&load, &probing, probes, writer, fault_at.elapsed()).await?;
    let ready = readyz.await?;
    rows.extend([
        ("/readyz samples (every 100 ms)", json!(ready.samples)),
        ("/readyz 503 naming postgres_replica", json!(ready.failing)),
        ("/readyz body while down", json!(ready.failing_body)),
        (
            "/readyz 200 degraded naming postgres_replica",
            json!(ready.degraded),
        ),
        ("/readyz body while degraded", json!(ready.degraded_body)),
    ]);
    report(
        "replica",
        json!({"fault": format!("{:?}", a.fault).to_lowercase(), "fault_ms": a.fault_ms, "feeds": a.load.feeds, "runs": a.load.runs, "rate": a.load.rate}),
        rows,
    );
    Ok(())
}
