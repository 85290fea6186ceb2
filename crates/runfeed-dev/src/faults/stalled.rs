//! Slow readers: `--stalled` SSE clients open a stream on one run and never read (4 KiB
//! receive buffers) while that run changes `--changes` times with a `--output-kb` output, and
//! `--feeds` healthy long-poll followers keep receiving `--rate` changes/s. Figures: server RSS
//! growth per stalled client (after the big changes, and after the queue bound ended the
//! streams), the kernel's TCP memory per stalled client (the socket buffers RSS does not
//! show; the machine's, so run it on a machine without other TCP traffic), streams the bound
//! ended (`runfeed_feeds_stalled_streams_total`), the CPU the server and this tool (the
//! healthy followers' client) used while the run changed, and the healthy followers' delivery
//! p50/p99 without and with the stalled clients.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::load::{Load, LoadArgs};
use super::{
    metric_sum, metric_with, pct, proc_cpu_s, proc_rss, report, scrape, tcp_kernel_memory, Target,
};
use crate::fixtures::{self, RunSpec, RunUpdate};

/// `runfeed-faults stalled`.
#[derive(Args, Clone, Debug)]
pub struct StalledArgs {
    #[command(flatten)]
    pub target: Target,
    /// SSE clients that stop reading.
    #[arg(long, default_value_t = 500)]
    pub stalled: usize,
    /// Changes of the stalled clients' run.
    #[arg(long, default_value_t = 40)]
    pub changes: u64,
    /// Output size of each of those changes, KiB.
    #[arg(long, default_value_t = 512)]
    pub output_kb: usize,
    /// The healthy followers (long polls) and their changes.
    #[command(flatten)]
    pub load: LoadArgs,
    /// Seconds to wait after the big changes for the stall timeout to end the streams.
    #[arg(long, default_value_t = 20)]
    pub settle_s: u64,
}

/// Runs the scenario and prints its figures.
pub async fn run(a: StalledArgs) -> anyhow::Result<()> {
    let pid = a
        .target
        .server_pid
        .context("--server-pid is needed for RSS")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let load = Load::start(&a.target, a.load.feeds, a.load.runs).await?;
    let writer = load.start_writer(a.load.rate);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = load.take_latencies();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let baseline = load.take_latencies();

    let big = fixtures::create_run(&load.pool, &load.env, RunSpec::default()).await?;
    let token = runfeed::auth::mint_public_token(
        &load.env.api_key,
        &load.env.env_id,
        &[format!("read:runs:{}", big.friendly_id)],
        Duration::from_secs(3600),
        None,
    )?;
    let base = a.target.base_url.trim_end_matches('/');
    let snap = http
        .get(format!(
            "{base}/realtime/v1/runs/{}?offset=-1&log=full",
            big.friendly_id
        ))
        .bearer_auth(&token)
        .header("x-trigger-electric-version", "1.0.0-beta.1")
        .send()
        .await?;
    let h = |n: &str| {
        snap.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let target = format!(
        "/realtime/v1/runs/{}?handle={}&offset={}&live=true&live_sse=true&log=full",
        big.friendly_id,
        h("electric-handle"),
        h("electric-offset")
    );
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse()?;
    let rss_before = proc_rss(pid).unwrap_or(f64::NAN);
    let tcp_before = tcp_kernel_memory().unwrap_or(f64::NAN);
    let metrics_before = scrape(&http, &a.target).await?;
    let mut stalled = Vec::with_capacity(a.stalled);
    for _ in 0..a.stalled {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_recv_buffer_size(4096)?;
        let mut s = socket.connect(addr).await?;
        let head = format!(
            "GET {target} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
             x-trigger-electric-version: 1.0.0-beta.1\r\nAccept: text/event-stream\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await?;
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_open = proc_rss(pid).unwrap_or(f64::NAN);
    let metrics_open = scrape(&http, &a.target).await?;
    let _ = load.take_latencies();
    let cpu = || {
        (
            proc_cpu_s(pid).unwrap_or(f64::NAN),
            proc_cpu_s(std::process::id()).unwrap_or(f64::NAN),
        )
    };
    let cpu_open = cpu();
    let pad = "x".repeat(a.output_kb * 1024);
    for n in 0..a.changes {
        let output = format!("{{\"n\":{n},\"pad\":\"{pad}\"}}");
        let set = RunUpdate {
            output: Some(output),
            ..RunUpdate::default()
        };
        let ms = fixtures::update_run(&load.pool, &big.id, set).await?;
        let record = runfeed::changes::ChangeRecord {
            v: 1,
            run_id: big.id.as_str().into(),
            env_id: load.env.env_id.as_str().into(),
            tags: Some(Vec::new()),
            batch_id: None,
            updated_at_ms: Some(ms),
        };
        runfeed::redis::Publisher::connect(&runfeed::redis::RedisOptions::standalone(
            &a.target.redis_url,
        ))
        .await
        .map_err(|e| anyhow::anyhow!("publisher: {e}"))?
        .publish(&record)
        .await
        .map_err(|e| anyhow::anyhow!("publish: {e}"))?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_changed = proc_rss(pid).unwrap_or(f64::NAN);
    let tcp_changed = tcp_kernel_memory().unwrap_or(f64::NAN);
    let cpu_changed = cpu();
    let metrics_changed = scrape(&http, &a.target).await?;
    let during = load.take_latencies();
    tokio::time::sleep(Duration::from_secs(a.settle_s)).await;
    let rss_settled = proc_rss(pid).unwrap_or(f64::NAN);
    let metrics_after = scrape(&http, &a.target).await?;
    let ended = metric_sum(&metrics_after, "runfeed_feeds_stalled_streams_total").unwrap_or(0.0)
        - metric_sum(&metrics_before, "runfeed_feeds_stalled_streams_total").unwrap_or(0.0);
    drop(stalled);
    load.stop_writer();
    let _ = writer.await;
    let (behind, _) = load.converge(Duration::from_secs(60)).await;
    load.stop();
    // What the big changes cost the store and the router (healthy feeds' share included),
    // from the streams being open to the RSS sample after the changes.
    let delta = |name: &str, label: &str| {
        metric_with(&metrics_changed, name, label) - metric_with(&metrics_open, name, label)
    };
    let per = |rss: f64| (rss - rss_before) / a.stalled.max(1) as f64 / 1024.0;
    let per_tcp = (tcp_changed - tcp_before) / a.stalled.max(1) as f64 / 1024.0;
    report(
        "stalled",
        json!({"stalled": a.stalled, "changes": a.changes, "output_kb": a.output_kb, "feeds": a.load.feeds, "rate": a.load.rate}),
        vec![
            ("server RSS before, MiB", json!(rss_before / 1048576.0)),
            (
                "RSS per stalled client, streams open, KiB",
                json!(per(rss_open)),
            ),
            (
                "RSS per stalled client, after the changes, KiB",
                json!(per(rss_changed)),
            ),
            (
                "RSS per stalled client, after the bound, KiB",
                json!(per(rss_settled)),
            ),
            (
                "kernel TCP memory per stalled client, after the changes, KiB",
                json!(per_tcp),
            ),
            ("streams ended by the queue bound", json!(ended)),
            (
                "server CPU while the run changed, s",
                json!(cpu_changed.0 - cpu_open.0),
            ),
            (
                "this tool's CPU while the run changed, s",
                json!(cpu_changed.1 - cpu_open.1),
            ),
            (
                "Postgres queries during the changes",
                json!(delta("runfeed_pg_queries_total", "")),
            ),
            (
                "router hydrates during the changes",
                json!(delta("runfeed_router_hydrates_total", "")),
            ),
            (
                "router replays delivered during the changes",
                json!(delta("runfeed_router_replays_total", "delivered")),
            ),
            (
                "run-set resolves miss / hit / coalesced",
                json!(format!(
                    "{} / {} / {}",
                    delta("runfeed_runset_resolves_total", "\"miss\""),
                    delta("runfeed_runset_resolves_total", "\"hit\""),
                    delta("runfeed_runset_resolves_total", "\"coalesced\"")
                )),
            ),
            (
                "live polls cold / full re-check",
                json!(format!(
                    "{} / {}",
                    delta("runfeed_feeds_live_polls_total", "cold-resolve"),
                    delta("runfeed_feeds_live_polls_total", "full-resolve")
                )),
            ),
            (
                "healthy delivery p50 without, ms",
                json!(pct(&baseline, 50.0)),
            ),
            (
                "healthy delivery p99 without, ms",
                json!(pct(&baseline, 99.0)),
            ),
            (
                "healthy delivery p50 with stalled, ms",
                json!(pct(&during, 50.0)),
            ),
            (
                "healthy delivery p99 with stalled, ms",
                json!(pct(&during, 99.0)),
            ),
            ("healthy followers behind after 60 s", json!(behind)),
            (
                "5xx seen by healthy clients",
                json!(load.outcomes.server_errors.load(Ordering::Relaxed)),
            ),
        ],
    );
    Ok(())
}
