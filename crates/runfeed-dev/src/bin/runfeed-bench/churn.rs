//! `churn`: R changes/s over E environments with H held feeds; publish → delivery latency and CPU per delivery.

use super::conn::Conn;
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

/// A run the churn changes: its environment, internal id and tag.
struct ChurnTarget {
    env: Arc<DemoEnv>,
    id: String,
    tag: String,
}

/// When each target's latest change was published, readable by every follower without a lock:
/// nanoseconds after `origin` (0: never), indexed like the targets.
struct Stamps {
    origin: Instant,
    index: HashMap<String, usize>,
    at: Vec<AtomicU64>,
}

impl Stamps {
    fn new(targets: &[ChurnTarget]) -> Stamps {
        Stamps {
            origin: Instant::now(),
            index: targets
                .iter()
                .enumerate()
                .map(|(i, t)| (t.id.clone(), i))
                .collect(),
            at: targets.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn stamp(&self, target: usize, at: Instant) {
        let ns = at.duration_since(self.origin).as_nanos().max(1);
        self.at[target].store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Release);
    }

    /// The publish time of run `id`'s latest change, if it has one.
    fn published(&self, id: &str) -> Option<Instant> {
        let ns = self.at[*self.index.get(id)?].load(Ordering::Acquire);
        (ns > 0).then(|| self.origin + Duration::from_nanos(ns))
    }
}

/// What the followers and the publisher of one pass share.
struct Shared {
    stamps: Stamps,
    latencies: Mutex<Vec<f64>>,
    errors: AtomicU64,
    /// Live-poll failures by kind (status or transport error), printed with the figures.
    error_kinds: Mutex<HashMap<String, u64>>,
    stop: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Records a delivery of run `id` received at `now` (a run never published is not one).
    fn delivered(&self, id: &str, now: Instant) {
        if let Some(t) = self.stamps.published(id) {
            self.latencies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(ms(now.duration_since(t)));
        }
    }

    fn failed(&self, kind: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *self
            .error_kinds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_insert(0) += 1;
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// One follower: a snapshot, then live long-polls in a loop on one kept-alive connection of its
/// own, recording each delivery's latency.
async fn follow_long_poll(s: Arc<Shared>, mut conn: Conn, token: String, feed: Feed) {
    let (path, params) = feed.snapshot_request();
    let mut at = match conn.get(&token, &path, &params).await {
        Ok(r) if r.status == 200 => r,
        _ => {
            s.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    while !s.stopped() {
        let (path, params) = feed.live_request(&at);
        match conn.get(&token, &path, &params).await {
            Ok(r) if r.status == 200 => {
                let now = Instant::now();
                for id in r.changed_ids() {
                    s.delivered(&id, now);
                }
                at = r;
            }
            Ok(r) if r.status == 409 => {
                // Must refetch: start over.
                let (path, params) = feed.snapshot_request();
                match conn.get(&token, &path, &params).await {
                    Ok(r) if r.status == 200 => at = r,
                    _ => return,
                }
            }
            other => {
                s.failed(match other {
                    Ok(r) => format!("status {}", r.status),
                    Err(e) => format!("{e:#}").chars().take(120).collect(),
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One follower over SSE: one stream at a time; a server-ended stream is reopened at
/// `<lsn>_0` (what the 1.5 client does), a 409 starts over.
async fn follow_sse(s: Arc<Shared>, b: Arc<Bench>, token: String, feed: Feed) {
    let feed = &feed;
    let client = b.client().clone();
    let Ok(mut at) = b.snapshot(&token, feed).await else {
        s.errors.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let mut offset: Option<String> = None;
    while !s.stopped() {
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
                s.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        while let Some(data) = reader.next_data().await {
            let Ok(msg) = serde_json::from_str::<Value>(&data) else {
                continue;
            };
            if let Some(id) = msg["value"]["id"].as_str() {
                s.delivered(id, Instant::now());
            }
            if let Some(lsn) = msg["headers"]["global_last_seen_lsn"].as_str() {
                offset = Some(format!("{lsn}_0"));
            }
        }
    }
}

/// The shortest pause between two batches of changes: at high rates one batch (one Postgres
/// statement, one burst of pipelined publishes) carries every change due in this time.
const MIN_TICK: Duration = Duration::from_millis(5);

/// Publishes `total` changes at `rate` per second, change `i` of target `(i × 7919) mod n`
/// (every target once per n consecutive changes), from `start`. Each tick takes the changes due
/// so far (at most one per target): one `UPDATE` of them all, then each change's publish time
/// is stamped and its record published (pipelined on one Redis connection, in a task of the
/// batch's own while the next batch is written). Returns when the last publish has its reply.
async fn publish_changes(
    b: &Arc<Bench>,
    s: &Arc<Shared>,
    targets: &Arc<Vec<ChurnTarget>>,
    rate: f64,
    total: u64,
) {
    let start = Instant::now();
    let rate = rate.max(0.001);
    let mut sent = 0u64;
    let mut batches = Vec::new();
    while sent < total {
        let tick = Instant::now();
        // Change i is due at start + i / rate.
        let due = ((tick.duration_since(start).as_secs_f64() * rate).floor() as u64 + 1).min(total);
        let n = due.saturating_sub(sent).min(targets.len() as u64);
        let batch: Vec<usize> = (sent..sent + n)
            .map(|i| (i as usize).wrapping_mul(7919) % targets.len())
            .collect();
        sent += n;
        if !batch.is_empty() {
            let ids: Vec<String> = batch.iter().map(|&t| targets[t].id.clone()).collect();
            match fixtures::update_runs_status(&b.pool, &ids, "EXECUTING").await {
                Ok(rows) => {
                    let (b, s, targets) = (b.clone(), s.clone(), targets.clone());
                    batches.push(tokio::spawn(async move {
                        publish_batch(&b, &s, &targets, batch, rows).await;
                    }));
                }
                Err(_) => {
                    s.errors.fetch_add(n, Ordering::Relaxed);
                }
            }
        }
        let next_due = start + Duration::from_secs_f64(sent as f64 / rate);
        tokio::time::sleep_until((tick + MIN_TICK).max(next_due).into()).await;
    }
    for p in batches {
        let _ = p.await;
    }
}

/// Stamps the publish time of the committed changes `rows` (`(run id, updatedAt ms)`) of
/// `batch` and publishes their change records.
async fn publish_batch(
    b: &Bench,
    s: &Shared,
    targets: &[ChurnTarget],
    batch: Vec<usize>,
    rows: Vec<(String, i64)>,
) {
    let committed: HashMap<String, i64> = rows.into_iter().collect();
    let now = Instant::now();
    let mut records = Vec::with_capacity(batch.len());
    for t in batch {
        let target = &targets[t];
        let Some(&ms) = committed.get(&target.id) else {
            s.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        // The publish time: after the commit, before the publish.
        s.stamps.stamp(t, now);
        records.push(ChangeRecord {
            v: 1,
            run_id: target.id.as_str().into(),
            env_id: target.env.env_id.as_str().into(),
            tags: Some(vec![target.tag.clone()]),
            batch_id: None,
            updated_at_ms: Some(ms),
        });
    }
    let results = futures::future::join_all(records.iter().map(|r| b.publisher.publish(r))).await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    s.errors.fetch_add(failed as u64, Ordering::Relaxed);
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
    let mut targets = Vec::new();
    for _ in 0..a.envs.max(1) {
        let env = Arc::new(b.env().await?);
        for r in 0..a.runs.max(1) {
            let tag = format!("churn{r}");
            let id = b.tagged_run(&env, &tag).await?;
            targets.push(ChurnTarget {
                env: env.clone(),
                id,
                tag,
            });
        }
    }
    let targets = Arc::new(targets);
    let s = Arc::new(Shared {
        stamps: Stamps::new(&targets),
        latencies: Mutex::default(),
        errors: AtomicU64::new(0),
        error_kinds: Mutex::default(),
        stop: std::sync::atomic::AtomicBool::new(false),
    });
    let conns = b.conn_targets().await?;

    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    // Followers: snapshot, then live polls in a loop, recording delivery latency.
    let mut followers = Vec::new();
    for i in 0..a.held {
        let target = &targets[i % targets.len()];
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{}", target.id)),
            FeedKind::Tag => Feed::tag(&target.tag),
        };
        let token = Bench::token(&target.env, &feed);
        followers.push(if sse {
            tokio::spawn(follow_sse(s.clone(), b.clone(), token, feed))
        } else {
            let conn = Conn::new(conns[i % conns.len()].clone());
            tokio::spawn(follow_long_poll(s.clone(), conn, token, feed))
        });
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
    publish_changes(&b, &s, &targets, a.rate, total).await;
    let publish_s = start.elapsed().as_secs_f64();
    // Drain: give the last deliveries time to arrive.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let cpu1 = b.server_cpu();
    let own1 = own_cpu_s();
    let window_s = start.elapsed().as_secs_f64();
    let bs1 = b.metric("runfeed_feeds_backstops_total").await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    let rc1 = b.redis_commands().await;
    s.stop.store(true, Ordering::Relaxed);
    for f in &followers {
        f.abort();
    }
    let mut lat = s
        .latencies
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    lat.sort_by(f64::total_cmp);
    let deliveries = lat.len();
    let cpu_per_1k = delta(cpu0, cpu1).map(|c| c / (deliveries.max(1) as f64) * 1000.0);
    b.wait_released(held_before, Duration::from_secs(30)).await;
    for (kind, n) in s
        .error_kinds
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
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
        (l("client errors"), json!(s.errors.load(Ordering::Relaxed))),
    ])
}
