//! Postgres faults under load: the server's database is an own instance (scripts/pg-instance.sh
//! on `--pg-port`, never the shared one) that is stopped for `--fault-ms` and started again
//! (`restart`), whose `max_connections` another client takes while runfeed's own connections
//! are cut (`exhaust`), or whose postmaster and backends are frozen with SIGSTOP (`freeze`),
//! while `--feeds` followers hold live polls and `--rate` changes/s are written (the writer's
//! own commits fail or wait during the fault: they are not counted). Figures: 5xx seen (all
//! must be JSON 503 with `Retry-After`), the slowest 503, followers behind after the fault
//! (lost updates), and the time until every follower converged.
//!
//! The freeze also publishes `--publish-rate` change records/s during the fault, each naming a
//! new run (never inserted) that `--tag-feeds` held tag feeds match, so every record needs a
//! hydrate that cannot happen: while a feed is held, the router's hydrate queue fills (and past
//! `router.max_queued_records` overflows). Its extra figures: the server's RSS (sampled every
//! second: before, peak, when the database came back, at the end),
//! `runfeed_router_queue_overflows_total`, how long into the fault a feed was still held, and
//! the arrivals routed since the fault began.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;
use tokio::time::Instant;

use super::load::{Load, LoadArgs};
use super::{metric_sum, proc_rss, report, scrape, Target};
use crate::client::{Applied, FeedUrl, Follower};
use runfeed::changes::ChangeRecord;

/// Which Postgres fault.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PgFault {
    /// `pg_ctl stop -m fast`, then start again after `--fault-ms`.
    Restart,
    /// Another client takes every connection slot for `--fault-ms` and runfeed's connections are
    /// terminated.
    Exhaust,
    /// SIGSTOP of the postmaster and every backend for `--fault-ms`, then SIGCONT: queries hang
    /// without an error (no connection closes) while `--publish-rate` records/s of new runs
    /// arrive.
    Freeze,
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
    /// `freeze` only: change records published per second during the fault, each naming a new
    /// run.
    #[arg(long, default_value_t = 2_000)]
    pub publish_rate: u32,
    /// `freeze` only: held tag feeds that match those records (so each needs a hydrate).
    #[arg(long, default_value_t = 10)]
    pub tag_feeds: usize,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// The tag the freeze's records carry and its tag feeds follow.
const FREEZE_TAG: &str = "fault-freeze";

/// How long a tag feed waits for an answer: longer than any hold, so a tag feed stays held
/// until the server ends its hold, never cut short by its own client.
const TAG_FEED_LIMIT: Duration = Duration::from_secs(3_600);

/// Pids of the own instance on `port`: its postmaster (the first line of
/// `/tmp/runfeed-pg-<port>/data/postmaster.pid`, scripts/pg-instance.sh's data directory) first,
/// then its children (backends and background workers).
fn instance_pids(port: u16) -> anyhow::Result<Vec<u32>> {
    let file = format!("/tmp/runfeed-pg-{port}/data/postmaster.pid");
    let text = std::fs::read_to_string(&file)?;
    let postmaster: u32 = text
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no postmaster pid in {file}"))?;
    let out = Command::new("pgrep")
        .args(["-P", &postmaster.to_string()])
        .output()?;
    let children = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect::<Vec<u32>>();
    Ok(std::iter::once(postmaster).chain(children).collect())
}

/// Sends `signal` (`-STOP`, `-CONT`) to `pids`.
fn signal(signal: &str, pids: &[u32]) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(signal)
        .args(pids.iter().map(u32::to_string))
        .status()?;
    anyhow::ensure!(status.success(), "kill {signal} {pids:?}");
    Ok(())
}

/// Processes stopped with SIGSTOP; dropping it sends them SIGCONT (also when the scenario
/// fails half-way: a frozen instance would outlive it). Also the frozen-database test of
/// `tests/it/faults_http.rs`.
pub struct Frozen(Vec<u32>);

impl Frozen {
    /// Stops the own instance on `port`: the postmaster first (it forks no backend while
    /// stopped), then every child it has.
    ///
    /// Errors: the data directory has no `postmaster.pid`, or `kill` fails.
    pub fn stop(port: u16) -> anyhow::Result<Frozen> {
        let pids = instance_pids(port)?;
        signal("-STOP", &pids[..1])?;
        let mut frozen = Frozen(pids[..1].to_vec());
        frozen.0 = instance_pids(port)?;
        signal("-STOP", &frozen.0)?;
        Ok(frozen)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Err(err) = signal("-CONT", &self.0) {
            eprintln!("runfeed-faults: SIGCONT {:?}: {err:#}", self.0);
        }
    }
}

/// One sample of the server, every second.
struct Sample {
    at: Instant,
    /// RSS, bytes.
    rss: f64,
    /// Feeds held (`runfeed_router_held_feeds`, every kind).
    held: f64,
    /// Arrivals routed so far (`runfeed_router_arrivals_total`).
    routed: f64,
    /// Records dropped on a full hydrate queue so far (`runfeed_router_queue_overflows_total`).
    overflows: f64,
}

/// The server's RSS and router figures every second until `stop` (the metrics read 0 when the
/// admin listener does not answer).
fn spawn_sampler(
    pid: u32,
    target: &Target,
    stop: &Arc<AtomicBool>,
) -> anyhow::Result<tokio::task::JoinHandle<Vec<Sample>>> {
    let (stop, target) = (stop.clone(), target.clone());
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(500))
        .build()?;
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut samples = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let text = scrape(&http, &target).await.unwrap_or_default();
            let metric = |name| metric_sum(&text, name).unwrap_or(0.0);
            if let Some(rss) = proc_rss(pid) {
                samples.push(Sample {
                    at: Instant::now(),
                    rss,
                    held: metric("runfeed_router_held_feeds"),
                    routed: metric("runfeed_router_arrivals_total"),
                    overflows: metric("runfeed_router_queue_overflows_total"),
                });
            }
        }
        samples
    }))
}

/// `n` followers of the tag feed of [`FREEZE_TAG`] (snapshot, then live polls, each waited
/// for up to [`TAG_FEED_LIMIT`]; 5xx and transport errors retried after 1 s) until `stop`;
/// returns once each had its snapshot (at most 60 s).
async fn hold_tag_feeds(
    load: &Arc<Load>,
    base: &str,
    n: usize,
    stop: &Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<()>(n.max(1));
    for _ in 0..n {
        let (http, stop, ready) = (http.clone(), stop.clone(), ready_tx.clone());
        let base = base.trim_end_matches('/').to_string();
        let mut follower = Follower::new(
            FeedUrl::tags(&[FREEZE_TAG.to_string()], None),
            &load.env.api_key,
        );
        tokio::spawn(async move {
            let mut announced = false;
            while !stop.load(Ordering::Relaxed) {
                match follower.step(&http, &base, TAG_FEED_LIMIT).await {
                    Ok((_, Applied::Changes(_))) => {
                        if !announced {
                            announced = true;
                            let _ = ready.send(()).await;
                        }
                    }
                    Ok((_, Applied::MustRefetch { .. })) => {}
                    Ok((_, Applied::Status(_))) | Err(_) => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
    }
    drop(ready_tx);
    let deadline = Instant::now() + Duration::from_secs(60);
    for got in 0..n {
        match tokio::time::timeout_at(deadline, ready_rx.recv()).await {
            Ok(Some(())) => {}
            _ => anyhow::bail!("only {got} of {n} tag feeds got their snapshot"),
        }
    }
    Ok(())
}

/// Publishes `rate` change records/s of new runs carrying [`FREEZE_TAG`] until `stop` (20
/// publishes every 10 ms at 2 000/s); returns `(published, failed)`.
fn spawn_new_run_records(
    load: &Arc<Load>,
    rate: u32,
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, u64)> {
    let (load, stop) = (load.clone(), stop.clone());
    tokio::spawn(async move {
        let per_tick = u64::from(rate.div_ceil(100).max(1));
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let (mut published, mut failed) = (0u64, 0u64);
        let mut next = 0u64;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let records: Vec<ChangeRecord> = (next..next + per_tick)
                .map(|i| ChangeRecord {
                    v: 1,
                    run_id: format!("freeze{i:012}").as_str().into(),
                    env_id: load.env.env_id.as_str().into(),
                    tags: Some(vec![FREEZE_TAG.to_string()]),
                    batch_id: None,
                    updated_at_ms: Some(runfeed::clock::now_ms()),
                })
                .collect();
            next += per_tick;
            let sent = futures::future::join_all(records.iter().map(|r| load.publish(r))).await;
            for ok in sent {
                if ok {
                    published += 1;
                } else {
                    failed += 1;
                }
            }
        }
        (published, failed)
    })
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
        PgFault::Freeze => {
            return freeze(a, load, probing, probes, writer).await;
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

/// The freeze: tag feeds held, RSS sampled, the instance frozen while records of new runs are
/// published, thawed; the figures of [`after_fault`] and the freeze's own.
async fn freeze(
    a: PostgresArgs,
    load: Arc<Load>,
    probing: Arc<AtomicBool>,
    probes: tokio::task::JoinHandle<(u64, u64)>,
    writer: tokio::task::JoinHandle<u64>,
) -> anyhow::Result<()> {
    let pid = a
        .target
        .server_pid
        .ok_or_else(|| anyhow::anyhow!("freeze needs --server-pid (RSS)"))?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let done = Arc::new(AtomicBool::new(false));
    hold_tag_feeds(&load, &a.target.base_url, a.tag_feeds, &done).await?;
    let overflows = |text: &str| metric_sum(text, "runfeed_router_queue_overflows_total");
    let before = overflows(&scrape(&http, &a.target).await?).unwrap_or(0.0);
    let sampler = spawn_sampler(pid, &a.target, &done)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let fault_at = Instant::now();
    let frozen = Frozen::stop(a.pg_port)?;
    let stop_publishing = Arc::new(AtomicBool::new(false));
    let publisher = spawn_new_run_records(&load, a.publish_rate, &stop_publishing);
    tokio::time::sleep(Duration::from_millis(a.fault_ms)).await;
    stop_publishing.store(true, Ordering::Relaxed);
    let published = publisher.await;
    drop(frozen); // SIGCONT
    let thawed_at = Instant::now();
    let (published, failed) = published?;
    let mut rows = after_fault(&load, &probing, probes, writer, fault_at.elapsed()).await?;
    let after = overflows(&scrape(&http, &a.target).await?).unwrap_or(0.0);
    done.store(true, Ordering::Relaxed);
    let samples = sampler.await?;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let first = samples.first().map_or(0.0, |s| mib(s.rss));
    let peak = samples.iter().map(|s| mib(s.rss)).fold(0.0, f64::max);
    let thawed = samples.iter().find(|s| s.at >= thawed_at);
    let end = samples.last().map_or(0.0, |s| mib(s.rss));
    // The last second of the fault with a feed held: until then the environment was subscribed.
    let held_until = samples
        .iter()
        .filter(|s| s.at >= fault_at && s.at < thawed_at && s.held > 0.0)
        .map(|s| (s.at - fault_at).as_secs_f64())
        .fold(0.0, f64::max);
    let routed = |at: Instant| {
        samples
            .iter()
            .find(|s| s.at >= at)
            .map_or(0.0, |s| s.routed)
    };
    // The RSS along the fault, and when the hydrate queue first overflowed (it is full from then).
    let into_fault = |secs: u64| {
        samples
            .iter()
            .find(|s| s.at >= fault_at + Duration::from_secs(secs) && s.at < thawed_at)
            .map_or_else(|| "-".to_string(), |s| format!("{:.1}", mib(s.rss)))
    };
    let rss_along = [10, 30, 60, 120, 240, 290].map(into_fault).join(" / ");
    let first_overflow = samples
        .iter()
        .find(|s| s.at >= fault_at && s.overflows > before)
        .map_or(json!(null), |s| json!((s.at - fault_at).as_secs()));
    rows.extend([
        (
            "records of new runs published during the fault",
            json!(published),
        ),
        ("  of which failed", json!(failed)),
        (
            "runfeed_router_queue_overflows_total (delta)",
            json!(after - before),
        ),
        (
            "last second of the fault with a feed held, s",
            json!(held_until),
        ),
        (
            "arrivals routed from the fault's start to the end",
            json!(samples.last().map_or(0.0, |s| s.routed) - routed(fault_at)),
        ),
        ("RSS before the fault, MiB", json!(first)),
        ("RSS peak, MiB", json!(peak)),
        (
            "RSS 10 / 30 / 60 / 120 / 240 / 290 s into the fault, MiB",
            json!(rss_along),
        ),
        ("first queue overflow, s into the fault", first_overflow),
        (
            "RSS when the database came back, MiB",
            json!(thawed.map_or(0.0, |s| mib(s.rss))),
        ),
        ("RSS at the end, MiB", json!(end)),
    ]);
    report(
        "postgres",
        json!({"fault": "freeze", "fault_ms": a.fault_ms, "feeds": a.load.feeds, "runs": a.load.runs, "rate": a.load.rate, "publish_rate": a.publish_rate, "tag_feeds": a.tag_feeds}),
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
