//! `stampede`: K distinct tag filters connect at once (cold); time to all snapshots and the Postgres queries they cost.

use super::*;

#[derive(Args)]
pub(crate) struct StampedeArgs {
    #[command(flatten)]
    common: Common,
    /// Distinct tag filters connecting at once.
    #[arg(long, default_value_t = 1000)]
    k: usize,
}

pub(crate) async fn stampede(a: StampedeArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let env = Arc::new(b.env().await?);
    // K runs, each with its own tag (written in parallel, 8 at a time).
    let tags: Vec<String> = (0..a.k).map(|i| format!("cold{i}")).collect();
    let created: Vec<anyhow::Result<String>> = stream::iter(tags.iter())
        .map(|t| {
            let (b, env) = (b.clone(), env.clone());
            async move { b.tagged_run(&env, t).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for c in created {
        c?;
    }
    let q0 = b.metric("runfeed_pg_queries_total").await;
    let sampler = AdmissionPeak::start(&b, Duration::from_millis(10));
    let started = Instant::now();
    let tasks: Vec<_> = tags
        .iter()
        .map(|t| {
            let (b, env, t) = (b.clone(), env.clone(), t.clone());
            tokio::spawn(async move {
                let token = Bench::token(&env, &Feed::tag(&t));
                let r = b.snapshot(&token, &Feed::tag(&t)).await;
                (r.is_ok(), Instant::now())
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        match t.await {
            Ok((true, at)) => lat.push(ms(at.duration_since(started))),
            _ => errors += 1,
        }
    }
    let total = started.elapsed();
    let peak = sampler.stop().await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    lat.sort_by(f64::total_cmp);
    report(
        &a.common,
        "stampede",
        json!({"k": a.k}),
        vec![
            ("time to all snapshots (ms)", json!(ms(total))),
            ("snapshot p50 (ms)", json!(pct(&lat, 50.0))),
            ("snapshot p99 (ms)", json!(pct(&lat, 99.0))),
            ("errors", json!(errors)),
            ("peak concurrent resolves (admission in use)", json!(peak)),
            ("postgres queries", opt(delta(q0, q1))),
        ],
    )
}
