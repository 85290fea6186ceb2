//! Redis faults under load: the server's Redis (standalone, on `--redis-port`, started by the
//! caller without persistence) is restarted, paused with `CLIENT PAUSE <ms> ALL`, or frozen with
//! SIGSTOP for `--fault-ms`, while `--feeds` followers hold live polls and `--rate` changes/s
//! are written until the fault ends (so the versions committed during the fault are the last
//! ones each run has). Figures: followers that never converged to the last committed version (lost
//! updates), time from the fault's end until a new change reaches every follower of a run via a
//! wake, backstop deliveries the fault cost, 5xx seen by clients.

use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;
use tokio::time::Instant;

use super::load::{Load, LoadArgs};
use super::{metric_with, pct, report, scrape, Target};

/// Which Redis fault.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RedisFault {
    /// `SHUTDOWN NOSAVE`, then a new redis-server on the same port after `--fault-ms`.
    Restart,
    /// `CLIENT PAUSE <fault-ms> ALL`: every client blocked, connections kept.
    Pause,
    /// SIGSTOP of redis-server for `--fault-ms`, then SIGCONT (a network partition that
    /// neither side notices).
    Freeze,
}

/// `runfeed-faults redis`.
#[derive(Args, Clone, Debug)]
pub struct RedisArgs {
    #[command(flatten)]
    pub target: Target,
    /// The fault.
    #[arg(long, value_enum)]
    pub fault: RedisFault,
    /// Port of the server's Redis (127.0.0.1); never the shared 6379.
    #[arg(long)]
    pub redis_port: u16,
    /// How long the fault lasts, ms.
    #[arg(long, default_value_t = 5_000)]
    pub fault_ms: u64,
    #[command(flatten)]
    pub load: LoadArgs,
}

fn redis_cli(port: u16, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn redis_pid(port: u16) -> anyhow::Result<i32> {
    let info = redis_cli(port, &["info", "server"])?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no redis-server answers on {port}"))
}

/// Runs the scenario and prints its figures.
pub async fn run(a: RedisArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.redis_port != 6379, "never the shared Redis");
    let pid = redis_pid(a.redis_port)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let load = Load::start(&a.target, a.load.feeds, a.load.runs).await?;
    let writer = load.start_writer(a.load.rate);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = scrape(&http, &a.target).await?;
    let _ = load.take_latencies();
    let port = a.redis_port.to_string();
    match a.fault {
        RedisFault::Restart => {
            let _ = redis_cli(a.redis_port, &["shutdown", "nosave"]);
            tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
            Command::new("redis-server")
                .args([
                    "--port",
                    &port,
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--daemonize", "yes"])
                .status()?;
        }
        RedisFault::Pause => {
            redis_cli(
                a.redis_port,
                &["client", "pause", &a.fault_ms.to_string(), "ALL"],
            )?;
            tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
        }
        RedisFault::Freeze => {
            Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status()?;
            tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
            Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status()?;
        }
    }
    let fault_over = Instant::now();
    // The writer stops with the fault: the versions committed during it are the last ones, so
    // they must reach every follower (by a wake after the reconnect, or a backstop).
    load.stop_writer();
    let written = writer.await?;
    let recovered = recovered_since(&load, fault_over).await?;
    let rows = settle(&load, &http, &a.target, &before, written, recovered).await?;
    report(
        "redis",
        json!({"fault": format!("{:?}", a.fault).to_lowercase(), "fault_ms": a.fault_ms, "feeds": a.load.feeds, "runs": a.load.runs, "rate": a.load.rate}),
        rows,
    );
    Ok(())
}

/// Recovered: a new change of run 0 reaches every follower of run 0 within 1 s; the time from
/// `since` until one did (`None` after 90 s).
pub(super) async fn recovered_since(
    load: &Arc<Load>,
    since: Instant,
) -> anyhow::Result<Option<Duration>> {
    while since.elapsed() < Duration::from_secs(90) {
        let n = load.commit(0).await?;
        let sent = Instant::now();
        while sent.elapsed() < Duration::from_secs(1) {
            if load.all_saw(0, n) {
                return Ok(Some(since.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(None)
}

/// Waits until every follower reached the last committed version (by a wake, or by the
/// backstop at the end of its hold, 20 s + jitter; at most 60 s), stops the load and returns
/// the figures of a Redis fault: lost updates, recovery, backstops, 5xx, delivery after it.
pub(super) async fn settle(
    load: &Load,
    http: &reqwest::Client,
    target: &Target,
    before: &str,
    written: u64,
    recovered: Option<Duration>,
) -> anyhow::Result<Vec<(&'static str, serde_json::Value)>> {
    let (behind, converged_in) = load.converge(Duration::from_secs(60)).await;
    let lat = load.take_latencies();
    let after = scrape(http, target).await?;
    let delivered = |text: &str| {
        metric_with(
            text,
            "runfeed_feeds_backstops_total",
            "result=\"delivered\"",
        )
    };
    let backstops = delivered(&after) - delivered(before);
    load.stop();
    Ok(vec![
        ("changes written", json!(written)),
        (
            "publishes failed",
            json!(load.publish_errors.load(Ordering::Relaxed)),
        ),
        ("followers behind after 60 s (lost updates)", json!(behind)),
        (
            "time until all converged, s",
            json!(converged_in.as_secs_f64()),
        ),
        (
            "recovered (wake path) after fault, s",
            json!(recovered.map(|d| d.as_secs_f64())),
        ),
        ("backstop deliveries", json!(backstops)),
        (
            "5xx seen by clients",
            json!(load.outcomes.server_errors.load(Ordering::Relaxed)),
        ),
        (
            "transport errors",
            json!(load.outcomes.transport_errors.load(Ordering::Relaxed)),
        ),
        ("delivery p50 after fault, ms", json!(pct(&lat, 50.0))),
        ("delivery p99 after fault, ms", json!(pct(&lat, 99.0))),
    ])
}
