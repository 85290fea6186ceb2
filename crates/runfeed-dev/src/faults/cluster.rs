//! A Redis Cluster primary failover under load: the server runs against a local cluster of 3
//! masters with one replica each (`scripts/redis-cluster.sh start --replicas 1`, sharded
//! pub/sub), `--feeds` followers hold live polls of one environment and `--rate` changes/s are
//! written while the master serving the environment's channel is failed over
//! (`scripts/redis-cluster.sh failover`: killed, so its replica is promoted after the cluster's
//! node timeout, then started again as a replica; or `--mode takeover`). The writer stops when
//! the cluster reports `cluster_state:ok` again. Figures (times from the start of the failover):
//! when the master stopped serving, followers that never converged to the last committed version
//! (lost updates), when a new change first reached every follower of a run via a wake, backstop
//! deliveries, 5xx seen by clients.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use fred::util::redis_keyslot;
use runfeed::changes::channel_name;
use serde_json::json;
use tokio::process::Command;
use tokio::time::Instant;

use super::load::{Load, LoadArgs};
use super::redis::{recovered_since, settle};
use super::{report, scrape, Target};

/// How the master is failed over (`scripts/redis-cluster.sh failover --mode`).
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FailoverMode {
    /// `SHUTDOWN NOSAVE` on the master: its replica is promoted once the other masters agree it
    /// failed (cluster-node-timeout, 5 s).
    Kill,
    /// `CLUSTER FAILOVER TAKEOVER` on its replica: no node goes down.
    Takeover,
}

/// `runfeed-faults redis-failover`.
#[derive(Args, Clone, Debug)]
pub struct FailoverArgs {
    #[command(flatten)]
    pub target: Target,
    /// Base port of the cluster (`scripts/redis-cluster.sh start --base-port P --replicas 1`);
    /// never the shared one of the tests (7100).
    #[arg(long)]
    pub cluster_base_port: u16,
    /// How the master is failed over.
    #[arg(long, value_enum, default_value = "kill")]
    pub mode: FailoverMode,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// The port of the master serving `slot`, from `CLUSTER NODES` of the node on `port`.
///
/// # Errors
/// When `redis-cli` cannot be run or no live master serves the slot.
pub async fn master_of(port: u16, slot: u16) -> anyhow::Result<u16> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "cluster", "nodes"])
        .output()
        .await
        .context("redis-cli cluster nodes")?;
    let nodes = String::from_utf8_lossy(&out.stdout);
    nodes
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 8 && f[2].contains("master") && !f[2].contains("fail"))
        .find(|f| {
            f[8..].iter().any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                matches!((lo.parse::<u16>(), hi.parse::<u16>()), (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot))
            })
        })
        .and_then(|f| f[1].split([':', '@']).nth(1)?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no master serves slot {slot} (is the cluster on {port} up?)"))
}

/// Whether the node on `port` answers and is a master.
async fn serves(port: u16) -> bool {
    let role = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "role"])
        .output()
        .await;
    matches!(role, Ok(out) if String::from_utf8_lossy(&out.stdout).lines().next() == Some("master"))
}

/// The time from `since` until a node of the cluster at `base` other than `master` says another
/// master serves `slot` (`None` after 60 s).
async fn promoted(base: u16, master: u16, slot: u16, since: Instant) -> Option<Duration> {
    while since.elapsed() < Duration::from_secs(60) {
        for port in (base..base + 6).filter(|&p| p != master) {
            if matches!(master_of(port, slot).await, Ok(p) if p != master) {
                return Some(since.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Runs the scenario and prints its figures.
pub async fn run(a: FailoverArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.cluster_base_port != 7100, "never the tests' cluster");
    let http = reqwest::Client::builder().no_proxy().build()?;
    let load = Load::start(&a.target, a.load.feeds, a.load.runs).await?;
    let slot = redis_keyslot(channel_name(&load.env.env_id).as_bytes());
    let master = master_of(a.cluster_base_port, slot).await?;
    let writer = load.start_writer(a.load.rate);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = scrape(&http, &a.target).await?;
    let _ = load.take_latencies();
    let mode = format!("{:?}", a.mode).to_lowercase();
    let started = Instant::now();
    let script = Command::new("bash")
        .args(["scripts/redis-cluster.sh", "failover", &master.to_string()])
        .args([
            "--base-port",
            &a.cluster_base_port.to_string(),
            "--mode",
            &mode,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .context("run scripts/redis-cluster.sh failover (from the repository's root)")?;
    // Probe while the failover runs, from the moment the master stopped serving its slots (gone,
    // or demoted by the takeover): the first new change of run 0 that reaches every follower of
    // run 0 after that.
    while serves(master).await {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "master {master} never went down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let demoted_after = started.elapsed();
    let (recovered, promoted_after) = tokio::join!(
        recovered_since(&load, started),
        promoted(a.cluster_base_port, master, slot, started)
    );
    let recovered = recovered?;
    let out = script.wait_with_output().await?;
    anyhow::ensure!(
        out.status.success(),
        "scripts/redis-cluster.sh failover failed"
    );
    let cluster_ok = started.elapsed();
    let promoted = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("PROMOTED=").map(str::to_string))
        .unwrap_or_default();
    load.stop_writer();
    let written = writer.await?;
    let mut rows = vec![
        (
            "failed master → promoted replica",
            json!(format!("{master} → {promoted}")),
        ),
        (
            "master stopped serving after, s",
            json!(demoted_after.as_secs_f64()),
        ),
        (
            "another node serves the slot after, s",
            json!(promoted_after.map(|d| d.as_secs_f64())),
        ),
        (
            "cluster_state:ok on every node after, s",
            json!(cluster_ok.as_secs_f64()),
        ),
    ];
    rows.extend(settle(&load, &http, &a.target, &before, written, recovered).await?);
    report(
        "redis-failover",
        json!({"mode": mode, "slot": slot, "feeds": a.load.feeds, "runs": a.load.runs, "rate": a.load.rate}),
        rows,
    );
    Ok(())
}
