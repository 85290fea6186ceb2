//! Reconnect storm: `--clients` clients (over `--runs` run feeds) took their snapshots; then all
//! of them send their live poll on new connections within `--spread-ms` (as after a deploy or
//! a load-balancer flip). Figures: 5xx, Postgres queries (total and peak per second, from
//! `runfeed_pg_queries_total`), the peak of cold-resolve admission permits in use
//! (`runfeed_runset_admission_in_use`, bounded by `feeds.resolve_admission_limit`), and the time
//! until the server holds every client's live poll.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use rand::Rng;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tokio::time::Instant;

use super::{metric_sum, report, scrape, Target};
use crate::fixtures::{self, DemoEnv, RunSpec};

/// `runfeed-faults storm`.
#[derive(Args, Clone, Debug)]
pub struct StormArgs {
    #[command(flatten)]
    pub target: Target,
    /// Clients that reconnect.
    #[arg(long, default_value_t = 10_000)]
    pub clients: usize,
    /// Runs they follow.
    #[arg(long, default_value_t = 1_000)]
    pub runs: usize,
    /// The reconnects are spread uniformly over this window, ms.
    #[arg(long, default_value_t = 1_000)]
    pub spread_ms: u64,
    /// Another instance (same database, Redis and handle secret) the clients reconnect to, as
    /// after a deploy: it has none of their per-connection state, so each live poll is a cold
    /// resolve. Default: the snapshot instance.
    #[arg(long)]
    pub storm_base_url: Option<String>,
    /// That instance's admin listener.
    #[arg(long)]
    pub storm_admin_url: Option<String>,
}

/// One client's feed and where its snapshot left it.
pub struct Parked {
    pub run: String,
    pub token: String,
    pub handle: String,
    pub offset: String,
}

/// An environment with `runs` runs and `clients` snapshots over them (200 at a time).
pub async fn snapshots(
    t: &Target,
    clients: usize,
    runs: usize,
) -> anyhow::Result<(DemoEnv, Vec<String>, Vec<Parked>)> {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&t.database_url)
        .await?;
    let env = fixtures::create_env(&pool, "DEVELOPMENT").await?;
    let mut ids = Vec::new();
    for _ in 0..runs.max(1) {
        let run = fixtures::create_run(&pool, &env, RunSpec::default()).await?;
        ids.push(run.id);
    }
    let http = reqwest::Client::builder().no_proxy().build()?;
    let base = t.base_url.trim_end_matches('/').to_string();
    let sem = Arc::new(tokio::sync::Semaphore::new(200));
    let mut tasks = Vec::new();
    for i in 0..clients {
        let run = format!("run_{}", ids[i % ids.len()]);
        let token = runfeed::auth::mint_public_token(
            &env.api_key,
            &env.env_id,
            &[format!("read:runs:{run}")],
            Duration::from_secs(3600),
            None,
        )?;
        let (http, base, sem) = (http.clone(), base.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await.ok();
            let r = http
                .get(format!("{base}/realtime/v1/runs/{run}?offset=-1&log=full"))
                .bearer_auth(&token)
                .header("x-trigger-electric-version", "1.0.0-beta.1")
                .send()
                .await?;
            anyhow::ensure!(r.status() == 200, "snapshot: {}", r.status());
            let h = |n: &str| {
                r.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string()
            };
            Ok(Parked {
                handle: h("electric-handle"),
                offset: h("electric-offset"),
                run,
                token,
            })
        }));
    }
    let mut parked = Vec::with_capacity(clients);
    for t in tasks {
        parked.push(t.await??);
    }
    pool.close().await;
    Ok((env, ids, parked))
}

/// A live poll of `p` on `client`; its status (None: no response).
pub async fn live(client: &reqwest::Client, base: &str, p: &Parked) -> Option<u16> {
    let url = format!(
        "{base}/realtime/v1/runs/{}?handle={}&offset={}&live=true&log=full",
        p.run, p.handle, p.offset
    );
    let r = client
        .get(url)
        .bearer_auth(&p.token)
        .header("x-trigger-electric-version", "1.0.0-beta.1")
        .send()
        .await
        .ok()?;
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    Some(status)
}

/// Runs the scenario and prints its figures.
pub async fn run(a: StormArgs) -> anyhow::Result<()> {
    let (_env, _ids, parked) = snapshots(&a.target, a.clients, a.runs)
        .await
        .context("snapshots")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut storm = a.target.clone();
    if let Some(base) = &a.storm_base_url {
        storm.base_url = base.clone();
    }
    if let Some(admin) = &a.storm_admin_url {
        storm.admin_url = admin.clone();
    }
    let a = StormArgs { target: storm, ..a };
    let before = scrape(&http, &a.target).await?;
    let held_before = metric_sum(&before, "runfeed_router_held_feeds").unwrap_or(0.0);
    let q0 = metric_sum(&before, "runfeed_pg_queries_total").unwrap_or(0.0);
    let clients: Vec<reqwest::Client> = (0..16)
        .map(|_| {
            reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(100_000)
                .timeout(Duration::from_secs(60))
                .build()
        })
        .collect::<Result<_, _>>()?;
    let base = a.target.base_url.trim_end_matches('/').to_string();
    let (fivexx, failed, answered) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, p) in parked.into_iter().enumerate() {
        let delay = Duration::from_millis(rand::rng().random_range(0..a.spread_ms.max(1)));
        let client = clients[i % clients.len()].clone();
        let (base, fivexx, failed, answered) = (
            base.clone(),
            fivexx.clone(),
            failed.clone(),
            answered.clone(),
        );
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            match live(&client, &base, &p).await {
                Some(s) if s >= 500 => fivexx.fetch_add(1, Ordering::Relaxed),
                Some(_) => answered.fetch_add(1, Ordering::Relaxed),
                None => failed.fetch_add(1, Ordering::Relaxed),
            };
        }));
    }
    // Sample queries and held feeds every 100 ms until every client is held (or 60 s).
    let (mut peak_qps, mut last_q, mut peak_permits) = (0.0f64, q0, 0.0f64);
    let mut all_held = None;
    while started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let m = scrape(&http, &a.target).await.unwrap_or_default();
        let q = metric_sum(&m, "runfeed_pg_queries_total").unwrap_or(last_q);
        peak_qps = peak_qps.max((q - last_q) * 10.0);
        last_q = q;
        peak_permits =
            peak_permits.max(metric_sum(&m, "runfeed_runset_admission_in_use").unwrap_or(0.0));
        let held = metric_sum(&m, "runfeed_router_held_feeds").unwrap_or(0.0) - held_before;
        if all_held.is_none()
            && held
                >= (a.clients as f64)
                    - fivexx.load(Ordering::Relaxed) as f64
                    - failed.load(Ordering::Relaxed) as f64
                    - answered.load(Ordering::Relaxed) as f64
            && started.elapsed() > Duration::from_millis(a.spread_ms)
        {
            all_held = Some(started.elapsed());
            break;
        }
    }
    let after = scrape(&http, &a.target).await?;
    let q1 = metric_sum(&after, "runfeed_pg_queries_total").unwrap_or(0.0);
    for t in &tasks {
        t.abort();
    }
    report(
        "storm",
        json!({"clients": a.clients, "runs": a.runs, "spread_ms": a.spread_ms, "other_instance": a.storm_base_url.is_some()}),
        vec![
            ("5xx", json!(fivexx.load(Ordering::Relaxed))),
            (
                "requests without a response",
                json!(failed.load(Ordering::Relaxed)),
            ),
            (
                "answered before held (changes, 409)",
                json!(answered.load(Ordering::Relaxed)),
            ),
            ("Postgres queries during the storm", json!(q1 - q0)),
            (
                "Postgres queries, peak per s (100 ms samples)",
                json!(peak_qps),
            ),
            ("admission permits in use, peak", json!(peak_permits)),
            (
                "every client on a live poll after, s",
                json!(all_held.map(|d| d.as_secs_f64())),
            ),
        ],
    );
    Ok(())
}
