//! `idle`: H held feeds while nothing changes; requests/s, Postgres queries/s and server CPU.

use super::*;

#[derive(Args)]
pub(crate) struct IdleArgs {
    #[command(flatten)]
    common: Common,
    /// Idle held feeds.
    #[arg(long, default_value_t = 1000)]
    held: usize,
    /// Distinct feeds they are spread over: tags (`--kind tag`) or runs (`--kind run`).
    #[arg(long, default_value_t = 50)]
    distinct: usize,
    /// Tag feeds (re-resolved by the reference at every backstop) or run feeds.
    #[arg(long, value_enum, default_value_t = FeedKind::Tag)]
    kind: FeedKind,
    /// Measurement window (s); longer than a hold (20 s) to include the backstops.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
}

pub(crate) async fn idle(a: IdleArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let env = Arc::new(b.env().await?);
    // The distinct feeds, each with its own token and snapshot.
    let mut feeds = Vec::new();
    for i in 0..a.distinct.max(1) {
        let tag = format!("idle{i}");
        let run_id = b.tagged_run(&env, &tag).await?;
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::Tag(tag),
        };
        let token = Bench::token(&env, &feed);
        let snap = Arc::new(b.snapshot(&token, &feed).await?);
        feeds.push((feed, token, snap));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    let errors = Arc::new(AtomicU64::new(0));
    let client_requests = Arc::new(AtomicU64::new(0));
    let mut followers = Vec::new();
    for i in 0..a.held {
        let (feed, token, at) = feeds[i % feeds.len()].clone();
        let (b, errors, reqs) = (b.clone(), errors.clone(), client_requests.clone());
        followers.push(tokio::spawn(async move {
            let client = b.client().clone();
            let mut at = Resp {
                status: at.status,
                handle: at.handle.clone(),
                offset: at.offset.clone(),
                cursor: at.cursor.clone(),
                body: Value::Null,
            };
            loop {
                reqs.fetch_add(1, Ordering::Relaxed);
                match b.live(&client, &token, &feed, &at).await {
                    Ok(r) if r.status == 200 || r.status == 204 => {
                        if r.handle.is_some() {
                            at = r;
                        }
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }));
    }
    let all_held = b
        .wait_held(held_before + a.held, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r0 = b.metric("runfeed_http_requests_total").await;
    let q0 = b.metric("runfeed_pg_queries_total").await;
    let rc0 = b.redis_commands().await;
    let own0 = own_cpu_s();
    let c0 = b.server_cpu();
    let cr0 = client_requests.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.duration_s)).await;
    let secs = t0.elapsed().as_secs_f64();
    let c1 = b.server_cpu();
    let own1 = own_cpu_s();
    let cr1 = client_requests.load(Ordering::Relaxed);
    let r1 = b.metric("runfeed_http_requests_total").await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    let rc1 = b.redis_commands().await;
    // Live polls that ended in the window (each one's hold expired and it was polled again).
    let polls = delta(r0, r1).unwrap_or(0.0);
    for f in &followers {
        f.abort();
    }
    report(
        &a.common,
        "idle",
        json!({"held": a.held, "distinct": a.distinct, "kind": format!("{:?}", a.kind).to_lowercase(), "duration_s": a.duration_s}),
        vec![
            ("all feeds held", json!(all_held)),
            ("client requests/s", json!((cr1 - cr0) as f64 / secs)),
            (
                "server requests/s (metric)",
                opt(delta(r0, r1).map(|d| d / secs)),
            ),
            ("postgres queries/s", opt(delta(q0, q1).map(|d| d / secs))),
            (
                "server CPU (% of one core)",
                opt(delta(c0, c1).map(|d| d / secs * 100.0)),
            ),
            (
                "server CPU per held feed (% of one core)",
                opt(delta(c0, c1).map(|d| d / secs * 100.0 / a.held.max(1) as f64)),
            ),
            (
                "server CPU per ended poll (us)",
                per_unit(c0, c1, polls, 1e6),
            ),
            ("redis commands per poll", per_unit(rc0, rc1, polls, 1.0)),
            ("redis commands/s", opt(delta(rc0, rc1).map(|d| d / secs))),
            ("postgres queries per poll", per_unit(q0, q1, polls, 1.0)),
            (
                "bench client CPU (% of one core)",
                opt(delta(own0, own1).map(|d| d / secs * 100.0)),
            ),
            ("client errors", json!(errors.load(Ordering::Relaxed))),
        ],
    )
}
