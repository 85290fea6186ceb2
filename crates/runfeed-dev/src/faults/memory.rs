//! Memory comes back: `--bursts` bursts of `--polls` live polls that are held and then aborted
//! by their clients, then a `--fanout`-feed fan-out (that many live polls on one run, one
//! change answers them all). Figures: server RSS before, at the peak, and `--settle-s` after
//! each phase, as a ratio of the value before.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use tokio::time::Instant;

use super::storm::{live, snapshots};
use super::{metric_sum, proc_rss, report, scrape, Target};
use crate::fixtures::{self, RunUpdate};

/// `runfeed-faults memory`.
#[derive(Args, Clone, Debug)]
pub struct MemoryArgs {
    #[command(flatten)]
    pub target: Target,
    /// Bursts of aborted polls.
    #[arg(long, default_value_t = 3)]
    pub bursts: usize,
    /// Live polls per burst.
    #[arg(long, default_value_t = 2_000)]
    pub polls: usize,
    /// Feeds of the fan-out (all on one run).
    #[arg(long, default_value_t = 10_000)]
    pub fanout: usize,
    /// Seconds RSS is watched after each phase.
    #[arg(long, default_value_t = 30)]
    pub settle_s: u64,
}

async fn wait_held(http: &reqwest::Client, t: &Target, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let m = scrape(http, t).await.unwrap_or_default();
        if metric_sum(&m, "runfeed_router_held_feeds").unwrap_or(0.0) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the scenario and prints its figures.
pub async fn run(a: MemoryArgs) -> anyhow::Result<()> {
    let pid = a
        .target
        .server_pid
        .context("--server-pid is needed for RSS")?;
    let rss = || proc_rss(pid).unwrap_or(f64::NAN) / 1048576.0;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let base = a.target.base_url.trim_end_matches('/').to_string();
    let (_env, _ids, parked) = snapshots(&a.target, a.polls, a.polls / 10).await?;
    let parked = std::sync::Arc::new(parked);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = rss();
    let mut peak = before;
    for _ in 0..a.bursts {
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()?;
        let mut tasks = Vec::new();
        for i in 0..parked.len() {
            let (client, base, parked) = (client.clone(), base.clone(), parked.clone());
            tasks.push(tokio::spawn(async move {
                live(&client, &base, &parked[i]).await
            }));
        }
        wait_held(&http, &a.target, parked.len() as f64).await;
        peak = peak.max(rss());
        for t in tasks {
            t.abort();
        }
        drop(client);
        tokio::time::sleep(Duration::from_secs(2)).await;
        peak = peak.max(rss());
    }
    let mut after_bursts = Vec::new();
    for _ in 0..a.settle_s {
        tokio::time::sleep(Duration::from_secs(1)).await;
        after_bursts.push(rss());
    }
    // Fan-out: every feed on one run, one change.
    let (env, ids, fan) = snapshots(&a.target, a.fanout, 1).await?;
    let fan_before = rss();
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(60))
        .build()?;
    let mut tasks = Vec::new();
    for p in fan {
        let (client, base) = (client.clone(), base.clone());
        tasks.push(tokio::spawn(async move { live(&client, &base, &p).await }));
    }
    wait_held(&http, &a.target, a.fanout as f64).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&a.target.database_url)
        .await?;
    let set = RunUpdate {
        status: Some("EXECUTING".into()),
        ..RunUpdate::default()
    };
    let ms = fixtures::update_run(&pool, &ids[0], set).await?;
    let publisher = runfeed::redis::Publisher::connect(&runfeed::redis::RedisOptions::standalone(
        &a.target.redis_url,
    ))
    .await
    .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
    publisher
        .publish(&runfeed::changes::ChangeRecord {
            v: 1,
            run_id: ids[0].as_str().into(),
            env_id: env.env_id.as_str().into(),
            tags: Some(Vec::new()),
            batch_id: None,
            updated_at_ms: Some(ms),
        })
        .await
        .map_err(|e| anyhow::anyhow!("publish: {e}"))?;
    let fan_started = Instant::now();
    let mut ok = 0;
    let mut fan_peak = rss();
    for t in tasks {
        if t.await.ok().flatten() == Some(200) {
            ok += 1;
        }
    }
    let fan_took = fan_started.elapsed();
    fan_peak = fan_peak.max(rss());
    drop(client);
    let mut after_fan = Vec::new();
    for _ in 0..a.settle_s {
        tokio::time::sleep(Duration::from_secs(1)).await;
        after_fan.push(rss());
    }
    let states = metric_sum(
        &scrape(&http, &a.target).await?,
        "runfeed_feeds_working_set_size",
    )
    .unwrap_or(0.0);
    let last = |v: &[f64]| v.last().copied().unwrap_or(f64::NAN);
    let within = |v: &[f64], base: f64| {
        v.iter()
            .position(|&r| r <= base * 1.25)
            .map(|i| i as f64 + 1.0)
    };
    report(
        "memory",
        json!({"bursts": a.bursts, "polls": a.polls, "fanout": a.fanout, "settle_s": a.settle_s}),
        vec![
            ("RSS before the bursts, MiB", json!(before)),
            ("RSS peak during the bursts, MiB", json!(peak)),
            (
                "RSS settle_s after the bursts, MiB",
                json!(last(&after_bursts)),
            ),
            (
                "after bursts: within 25 % of before after, s",
                json!(within(&after_bursts, before)),
            ),
            ("RSS before the fan-out, MiB", json!(fan_before)),
            ("RSS peak of the fan-out, MiB", json!(fan_peak)),
            ("fan-out answered 200", json!(ok)),
            (
                "fan-out: change to last response, ms",
                json!(fan_took.as_secs_f64() * 1000.0),
            ),
            (
                "RSS settle_s after the fan-out, MiB",
                json!(last(&after_fan)),
            ),
            (
                "after fan-out: within 25 % of before after, s",
                json!(within(&after_fan, fan_before)),
            ),
            ("per-connection states kept then (300 s TTL)", json!(states)),
        ],
    );
    Ok(())
}
