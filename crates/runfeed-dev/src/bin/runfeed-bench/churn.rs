//! `churn`: R changes/s over E environments with H held feeds; publish → delivery latency and CPU per delivery.

use super::*;

#[derive(Args)]
pub(crate) struct ChurnArgs {
    #[command(flatten)]
    common: Common,
    /// Changes per second.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Environments.
    #[arg(long, default_value_t = 4)]
    envs: usize,
    /// Held feeds (spread over the environments; each follows one run's tag).
    #[arg(long, default_value_t = 200)]
    held: usize,
    /// Runs per environment (each with its own tag).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Duration of the churn (s).
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// What each held feed follows: one run's tag (default) or the run itself.
    #[arg(long, value_enum, default_value_t = FeedKind::Tag)]
    kind: FeedKind,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
}

pub(crate) async fn churn(a: ChurnArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows = Vec::new();
    for sse in passes {
        rows.extend(churn_pass(&b, &a, sse, several).await?);
    }
    report(
        &a.common,
        "churn",
        json!({"rate": a.rate, "envs": a.envs, "held": a.held, "runs_per_env": a.runs, "duration_s": a.duration_s, "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )
}

/// One churn pass (long-polls, or SSE streams when `sse`); its figures, labelled by transport
/// when `several` passes share the table.
async fn churn_pass(
    b: &Arc<Bench>,
    a: &ChurnArgs,
    sse: bool,
    several: bool,
) -> anyhow::Result<Vec<(String, Value)>> {
    let b = b.clone();
    // E environments × runs, each run with its own tag.
    let mut targets: Vec<(Arc<DemoEnv>, String, String)> = Vec::new();
    for _ in 0..a.envs.max(1) {
        let env = Arc::new(b.env().await?);
        for r in 0..a.runs.max(1) {
            let tag = format!("churn{r}");
            let id = b.tagged_run(&env, &tag).await?;
            targets.push((env.clone(), id, tag));
        }
    }
    let published: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let errors = Arc::new(AtomicU64::new(0));
    // Live-poll failures by kind (status or transport error), printed with the figures.
    let error_kinds: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    // Followers: snapshot, then live polls in a loop, recording delivery latency.
    let mut followers = Vec::new();
    for i in 0..a.held {
        let (env, run_id, tag) = targets[i % targets.len()].clone();
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::tag(&tag),
        };
        let (b, published, latencies, errors, stop) = (
            b.clone(),
            published.clone(),
            latencies.clone(),
            errors.clone(),
            stop.clone(),
        );
        let kinds = error_kinds.clone();
        followers.push(tokio::spawn(async move {
            let feed = &feed;
            let token = Bench::token(&env, feed);
            let client = b.client().clone();
            let mut at = match b.snapshot(&token, feed).await {
                Ok(r) => r,
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            if sse {
                // One stream at a time; a server-ended stream is reopened at `<lsn>_0` (what
                // the 1.5 client does), a 409 starts over.
                let mut offset: Option<String> = None;
                while !stop.load(Ordering::Relaxed) {
                    let reader = b
                        .open_sse(&client, &token, feed, &at, offset.as_deref())
                        .await;
                    let mut reader = match reader {
                        Ok(r) if r.status == 200 => r,
                        Ok(r) if r.status == 409 => {
                            match b.snapshot(&token, feed).await {
                                Ok(r) => at = r,
                                Err(_) => return,
                            }
                            offset = None;
                            continue;
                        }
                        _ => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    while let Some(data) = reader.next_data().await {
                        let Ok(msg) = serde_json::from_str::<Value>(&data) else {
                            continue;
                        };
                        if let Some(id) = msg["value"]["id"].as_str() {
                            let now = Instant::now();
                            let p = published.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(t) = p.get(id) {
                                latencies
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(ms(now.duration_since(*t)));
                            }
                        }
                        if let Some(lsn) = msg["headers"]["global_last_seen_lsn"].as_str() {
                            offset = Some(format!("{lsn}_0"));
                        }
                    }
                }
                return;
            }
            while !stop.load(Ordering::Relaxed) {
                match b.live(&client, &token, feed, &at).await {
                    Ok(r) if r.status == 200 => {
                        let now = Instant::now();
                        let ids = r.changed_ids();
                        if !ids.is_empty() {
                            let p = published.lock().unwrap_or_else(|p| p.into_inner());
                            let mut l = latencies.lock().unwrap_or_else(|p| p.into_inner());
                            for id in ids {
                                if let Some(t) = p.get(&id) {
                                    l.push(ms(now.duration_since(*t)));
                                }
                            }
                        }
                        at = r;
                    }
                    Ok(r) if r.status == 409 => {
                        // Must refetch: start over.
                        match b.snapshot(&token, feed).await {
                            Ok(r) => at = r,
                            Err(_) => return,
                        }
                    }
                    other => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        let kind = match other {
                            Ok(r) => format!("status {}", r.status),
                            Err(e) => format!("{e:#}").chars().take(120).collect(),
                        };
                        *kinds
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .entry(kind)
                            .or_insert(0) += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    // Wait until the followers are parked.
    let all_held = b
        .wait_held(held_before + a.held, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let bs0 = b.metric("runfeed_feeds_backstops_total").await;
    let q0 = b.metric("runfeed_pg_queries_total").await;
    let rc0 = b.redis_commands().await;
    let own0 = own_cpu_s();
    let cpu0 = b.server_cpu();
    let start = Instant::now();
    let total = (a.rate * a.duration_s).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / a.rate.max(0.001));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut publishes = Vec::new();
    for i in 0..total {
        ticker.tick().await;
        let (env, id, tag) = targets[(i as usize * 7919) % targets.len()].clone();
        let (b, published, errors) = (b.clone(), published.clone(), errors.clone());
        publishes.push(tokio::spawn(async move {
            // Stamp the publish time between the Postgres update and the Redis publish.
            let ms = fixtures::update_run(
                &b.pool,
                &id,
                RunUpdate {
                    status: Some("EXECUTING".into()),
                    ..RunUpdate::default()
                },
            )
            .await;
            let Ok(ms) = ms else {
                errors.fetch_add(1, Ordering::Relaxed);
                return;
            };
            published
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id.clone(), Instant::now());
            let record = ChangeRecord {
                v: 1,
                run_id: id.into(),
                env_id: env.env_id.as_str().into(),
                tags: Some(vec![tag]),
                batch_id: None,
                updated_at_ms: Some(ms),
            };
            if b.publisher.publish(&record).await.is_err() {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for p in publishes {
        let _ = p.await;
    }
    let publish_s = start.elapsed().as_secs_f64();
    // Drain: give the last deliveries time to arrive.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let cpu1 = b.server_cpu();
    let own1 = own_cpu_s();
    let window_s = start.elapsed().as_secs_f64();
    let bs1 = b.metric("runfeed_feeds_backstops_total").await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    let rc1 = b.redis_commands().await;
    stop.store(true, Ordering::Relaxed);
    for f in &followers {
        f.abort();
    }
    let mut lat = latencies.lock().unwrap_or_else(|p| p.into_inner()).clone();
    lat.sort_by(f64::total_cmp);
    let deliveries = lat.len();
    let cpu_per_1k = delta(cpu0, cpu1).map(|c| c / (deliveries.max(1) as f64) * 1000.0);
    b.wait_released(held_before, Duration::from_secs(30)).await;
    for (kind, n) in error_kinds.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        eprintln!("churn: {n} live polls failed: {kind}");
    }
    let l = |figure: &str| label(figure, sse, several);
    Ok(vec![
        (l("all feeds held"), json!(all_held)),
        (l("changes published"), json!(total)),
        (l("achieved changes/s"), json!(total as f64 / publish_s)),
        (l("deliveries (feed × change)"), json!(deliveries)),
        (l("delivery latency p50 (ms)"), json!(pct(&lat, 50.0))),
        (l("delivery latency p99 (ms)"), json!(pct(&lat, 99.0))),
        (l("delivery latency p99.9 (ms)"), json!(pct(&lat, 99.9))),
        (l("server CPU s per 1000 deliveries"), opt(cpu_per_1k)),
        (
            l("server CPU per delivery (us)"),
            per_unit(cpu0, cpu1, deliveries as f64, 1e6),
        ),
        (
            l("server CPU per change (us)"),
            per_unit(cpu0, cpu1, total as f64, 1e6),
        ),
        (
            l("redis commands per delivery"),
            per_unit(rc0, rc1, deliveries as f64, 1.0),
        ),
        (
            l("postgres queries per change"),
            per_unit(q0, q1, total as f64, 1.0),
        ),
        (
            l("server CPU (% of one core)"),
            opt(delta(cpu0, cpu1).map(|d| d / window_s * 100.0)),
        ),
        (
            l("bench client CPU (% of one core)"),
            opt(delta(own0, own1).map(|d| d / window_s * 100.0)),
        ),
        (l("backstop deliveries"), opt(delta(bs0, bs1))),
        (l("client errors"), json!(errors.load(Ordering::Relaxed))),
    ])
}
