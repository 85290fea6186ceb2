//! `held`: server RSS per held feed against the bare server (`bare`) parking the same number of
//! requests.

use super::*;

#[derive(Args)]
pub(crate) struct HeldArgs {
    #[command(flatten)]
    common: Common,
    /// Held feeds.
    #[arg(long, default_value_t = 2000)]
    n: usize,
    /// How long to keep them parked after all are held (ms).
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Skip the bare-server baseline.
    #[arg(long)]
    no_bare: bool,
    /// Which feeds to park: one run's feed (the unit) or one tag's.
    #[arg(long, value_enum, default_value_t = FeedKind::Run)]
    kind: FeedKind,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
}

pub(crate) async fn held(a: HeldArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows: Vec<(String, Value)> = Vec::new();
    for sse in passes {
        let env = b.env().await?;
        let run_id = b.tagged_run(&env, "held").await?;
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::tag("held"),
        };
        let token = Bench::token(&env, &feed);
        let snap = Arc::new(b.snapshot(&token, &feed).await?);
        // Let the environment's subscription confirm, then measure before/after.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss_before = b.server_rss().await;
        let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
        let started = Instant::now();
        let park_what = Park {
            n: a.n,
            token: &token,
            feed: &feed,
            at: &snap,
            sse,
        };
        let tasks = park(&b, park_what);
        let all_held = b
            .wait_held(held_before + a.n, Duration::from_secs(60))
            .await;
        let time_to_hold = started.elapsed();
        tokio::time::sleep(Duration::from_millis(a.settle_ms)).await;
        let rss_after = b.server_rss().await;
        for t in &tasks {
            t.abort();
        }
        b.wait_released(held_before, Duration::from_secs(30)).await;
        let per_feed = delta(rss_before, rss_after).map(|d| d / a.n as f64);
        let l = |figure: &str| label(figure, sse, several);
        rows.extend([
            (l("all feeds held"), json!(all_held)),
            (l("time to hold all (ms)"), json!(ms(time_to_hold))),
            (
                l("server RSS before (MiB)"),
                opt(rss_before.map(|x| x / 1048576.0)),
            ),
            (
                l("server RSS held (MiB)"),
                opt(rss_after.map(|x| x / 1048576.0)),
            ),
            (
                l("server RSS per held feed (KiB)"),
                opt(per_feed.map(|x| x / 1024.0)),
            ),
        ]);
    }

    // Bare-server baseline: a child process parking the same number of requests.
    let mut bare_per_feed = None;
    if !a.no_bare {
        bare_per_feed = bare_baseline(&b, a.n, a.settle_ms).await.ok();
    }
    rows.push((
        "bare server RSS per parked request (KiB)".into(),
        opt(bare_per_feed.map(|x| x / 1024.0)),
    ));
    report(
        &a.common,
        "held",
        json!({"n": a.n, "kind": format!("{:?}", a.kind).to_lowercase(), "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )
}

async fn bare_baseline(b: &Arc<Bench>, n: usize, settle_ms: u64) -> anyhow::Result<f64> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["bare", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("bare pid")?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await??
        .context("bare server printed nothing")?;
    let base = line
        .strip_prefix("bare listening on ")
        .context("bare server banner")?
        .to_string();
    let counter = format!("{base}/count");
    let rss_before = proc_rss(pid).context("bare rss")?;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let client = b.client().clone();
            let url = format!("{base}/realtime/v1/runs?live=true");
            tokio::spawn(async move { client.get(url).send().await.map(|r| r.status()) })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let parked: usize = b
            .probe
            .get(&counter)
            .send()
            .await?
            .text()
            .await?
            .trim()
            .parse()
            .unwrap_or(0);
        if parked >= n || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(settle_ms)).await;
    let rss_after = proc_rss(pid).context("bare rss")?;
    for t in tasks {
        t.abort();
    }
    let _ = child.kill().await;
    Ok((rss_after - rss_before) / n as f64)
}
